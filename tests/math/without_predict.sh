#!/bin/sh
# meshtrain ($MESHTRAIN_BINARY) as a build without the predict command: `predict` fails as an
# unknown command would (one line on stderr, exit 2), every other command runs. The launcher
# of math_reproduce_without_predict: reproduce.py must fail there, not pass uncompared.
if [ "${1:-}" = "predict" ]; then
  echo "meshtrain: unknown command 'predict' (tests/math/without_predict.sh)" >&2
  exit 2
fi
exec "$MESHTRAIN_BINARY" "$@"
