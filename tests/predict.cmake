# Inference (issue 26): Predictor and `meshtrain predict`.
# Predictor and the predict command against a float64 forward written in the test, on dp,
# fsdp, tp, fsdp x tp (2x4 at np 8) and an MoE model on ep; normalization; row order over
# shards and padding; no allocation per call.
meshtrain_add_test(NAME predict_predictor_test SOURCES predict/predictor_test.cpp
                   LIBS meshtrain_command NP 1 2 4 8 TIMEOUT 120)
