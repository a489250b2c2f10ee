#pragma once
// meshtrain, in one include: what a program needs to build a mesh, partition rules, a
// model and a training run in code (or from TOML), and to run it under mpirun.
//
//   #include <meshtrain/meshtrain.hpp>
//   meshtrain::Runtime runtime(argc, argv);
//   meshtrain::RunConfig config;  ...  meshtrain::TrainingRun run(config);  run.train();
//
//   meshtrain::Predictor model("run/checkpoints", 256);  model.predict(x, y);  // inference
//
// docs/library.md walks through it; examples/train_mlp and examples/predict_surrogate are
// complete programs.

#include "framework/comm/backend.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/metrics.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/train/config.hpp"
#include "layers/mlp.hpp"
#include "layers/physics_loss.hpp"  // physics losses (docs/derivatives.md)
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "run/dlrm_predictor.hpp"
#include "run/predictor.hpp"
#include "run/training_run.hpp"
