#pragma once
// meshtrain's stream producer (docs/online.md): a simulation's ranks send rows to a trainer
// running in the same MPI job. Installed as <meshtrain/stream.hpp>; C: <meshtrain/stream.h>.

#include "framework/stream/producer.hpp"
