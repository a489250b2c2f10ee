// A small program that trains an MLP with meshtrain, without a TOML file: the mesh, the
// partition rules, the model sizes and the run are set in C++, then the run trains under
// mpirun and saves a checkpoint.
//
//   mpirun -np 2 train_mlp OUTPUT_DIR
//
// The mesh is fsdp over every rank; the rules shard each weight's input dimension over
// fsdp (FSDP: gathered before use, gradients reduce-scattered) and replicate the biases.

#include <meshtrain/meshtrain.hpp>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);  // MPI and Kokkos, for the whole program
  const bool rank0 = runtime.world_rank() == 0;
  if (argc != 2) {
    if (rank0) std::fprintf(stderr, "usage: mpirun -np N %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }

  meshtrain::RunConfig config;
  config.run.name = "train_mlp";
  config.run.seed = 1;
  config.run.output_dir = argv[1];  // metrics.jsonl and checkpoints/
  // The mesh: one axis over every rank (-1: whatever the world size is).
  config.mesh.axes = {{"fsdp", -1}};
  // The model: 16 inputs, two hidden layers, 4 outputs (regression on synthetic data).
  config.model.sizes = {16, 64, 32, 4};
  config.model.activation = meshtrain::Activation::tanh;
  // Partition rules: a regex on the parameter name and a spec per dimension; the first
  // rule whose regex is found in the name wins.
  config.partition.rules = {
      {"layers/[0-9]+/weight", meshtrain::PartitionSpec::parse("P(fsdp, None)")},
      {"bias$", meshtrain::PartitionSpec::parse("P()")},
  };
  config.partition.min_sharding_size = 0;                 // shard even these small weights
  config.data.source = meshtrain::DataSource::synthetic;  // a regression set made from the seed
  config.data.synthetic_samples = 512;
  config.data.batch_size = 32;
  config.optimizer.kind = meshtrain::OptimizerKind::adamw;
  config.optimizer.lr = 3e-3;
  config.train.steps = 40;
  config.train.log_every = 10;

  meshtrain::RunEvents events;
  if (rank0) {
    events.on_log = [](const meshtrain::LogEvent& e) {
      std::printf("step %lld/%lld loss %.5f\n", static_cast<long long>(e.step),
                  static_cast<long long>(e.total_steps), e.loss);
    };
    events.on_eval = [](const meshtrain::EvalEvent& e) {
      std::printf("test loss %.5f at step %lld\n", e.test_loss, static_cast<long long>(e.step));
    };
    events.on_checkpoint = [](int64_t step, const std::string& path) {
      std::printf("checkpoint %s (step %lld)\n", path.c_str(), static_cast<long long>(step));
    };
  }

  try {
    meshtrain::TrainingRun run(config, events);
    if (rank0) {
      for (const std::string& line : run.describe()) std::printf("%s\n", line.c_str());
    }
    const meshtrain::RunSummary summary = run.train();  // saves a checkpoint at the end
    if (rank0) {
      std::printf("trained %lld steps in %.1f s\n", static_cast<long long>(summary.steps_run),
                  summary.wall_s);
    }
  } catch (const meshtrain::AgreedError& e) {
    // Every rank holds this error (a bad config, say): report it once, end normally.
    if (rank0) std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return e.kind() == meshtrain::ErrorKind::bad_input ? 2 : 1;
  }
  return 0;
}
