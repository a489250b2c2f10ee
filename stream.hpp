#pragma once
// meshtrain's stream producer (docs/online.md): a simulation's ranks send rows to a trainer
// running in the same MPI job, and take the trainer's model back as it trains (LiveModel).
// Installed as <meshtrain/stream.hpp>; C: <meshtrain/stream.h>.

#include "framework/stream/producer.hpp"
#include "run/live_model.hpp"
