// A physics-informed network for the 2-D Poisson problem on the unit square
//
//   -(d2u/dx2 + d2u/dy2) = f,  f = 2 pi^2 sin(pi x) sin(pi y),  u = 0 on the boundary,
//
// whose solution is u = sin(pi x) sin(pi y). No solution value is given to the training: the
// rows are collocation points (interior and boundary), and the loss is meshtrain's physics loss
// (docs/derivatives.md, "Physics losses"): a residual written below from u and its diagonal
// second derivatives, which meshtrain propagates forward through the network (the forward
// Laplacian) and backpropagates exactly. After training, the checkpoint's Predictor evaluates u
// on a 101 x 101 grid and the program prints the relative L2 error against the exact solution;
// it exits 1 when that is not below the bound given (default 1e-2).
//
//   mpirun -np N pinn_poisson OUTPUT_DIR [STEPS [ERROR_BOUND]]

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <meshtrain/framework/core/kokkos_math.hpp>  // kmath::sin in a kernel, any Kokkos
#include <meshtrain/meshtrain.hpp>

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr int64_t kInterior = 1024, kPerSide = 64;  // collocation points
constexpr float kBoundaryWeight = 2.0f;             // the boundary penalty's weight in r

// The collocation points as a data set: x [N, 2]; the targets (one column of zeros) are not
// used (the data loss's weight is 0).
meshtrain::Dataset collocation_points() {
  meshtrain::Dataset d;
  d.description = "Poisson collocation points";
  d.features = 2;
  d.target_width = 1;
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  auto add = [&](double x, double y) {
    d.inputs.push_back(static_cast<float>(x));
    d.inputs.push_back(static_cast<float>(y));
    d.targets.push_back(0.0f);
    ++d.num_samples;
  };
  for (int64_t i = 0; i < kInterior; ++i) add(uniform(gen), uniform(gen));
  for (int64_t i = 0; i < kPerSide; ++i) {
    const double s = (i + 0.5) / kPerSide;
    add(s, 0.0);
    add(s, 1.0);
    add(0.0, s);
    add(1.0, s);
  }
  return d;
}

// The residual per point: interior (lap u + f) / (2 pi^2) (the PDE, scaled to order 1);
// boundary kBoundaryWeight * u (u = 0 there). And its derivatives by u and d2u (the
// backward's seeds). du/dx is not used: its seeds stay 0.
void poisson_residual(const meshtrain::PhysicsPoints& p, const meshtrain::PhysicsResiduals& q) {
  const meshtrain::MatrixView x = p.x, u = p.u, d2u = p.d2u;
  const meshtrain::MatrixView r = q.r, dr_du = q.dr_du, dr_dd2u = q.dr_dd2u;
  const float scale = static_cast<float>(1.0 / (2.0 * kPi * kPi)), pi = static_cast<float>(kPi);
  Kokkos::parallel_for(
      "poisson_residual", Kokkos::RangePolicy<>(0, static_cast<int64_t>(u.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        const float px = x(i, 0), py = x(i, 1);
        const bool boundary = px <= 0.0f || px >= 1.0f || py <= 0.0f || py >= 1.0f;
        if (boundary) {
          r(i, 0) = kBoundaryWeight * u(i, 0);
          dr_du(i, 0) = kBoundaryWeight;
        } else {
          const float f =
              2.0f * pi * pi * meshtrain::kmath::sin(pi * px) * meshtrain::kmath::sin(pi * py);
          r(i, 0) = scale * (d2u(i, 0) + d2u(i, 1) + f);
          dr_dd2u(i, 0) = scale;  // d r / d (d2u/dx2)
          dr_dd2u(i, 1) = scale;  // d r / d (d2u/dy2)
        }
      });
}

// The relative L2 error of the checkpoint's model on a 101 x 101 grid against the exact
// solution, each rank predicting its share of the points (collective).
double grid_error(const std::string& checkpoints, const meshtrain::Runtime& runtime) {
  // The Predictor's batch divides over the ranks: the last rank's share may be short.
  constexpr int64_t kGrid = 101, kPoints = kGrid * kGrid;
  const int64_t ranks = runtime.world_size();
  const int64_t local = (kPoints + ranks - 1) / ranks;
  meshtrain::Predictor model(checkpoints, /*batch_size=*/local * ranks);
  const int64_t first = runtime.world_rank() * local;
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> xy("xy", local, 2),
      u("u", local, 1);
  int64_t rows = 0;
  for (int64_t p = first; p < first + local && p < kPoints; ++p, ++rows) {
    xy(rows, 0) = static_cast<float>(static_cast<double>(p / kGrid) / (kGrid - 1));
    xy(rows, 1) = static_cast<float>(static_cast<double>(p % kGrid) / (kGrid - 1));
  }
  model.predict(Kokkos::subview(xy, std::make_pair(int64_t{0}, rows), Kokkos::ALL), u);
  double sums[2] = {0.0, 0.0};  // sum (u - exact)^2, sum exact^2
  for (int64_t i = 0; i < rows; ++i) {
    const double exact = std::sin(kPi * xy(i, 0)) * std::sin(kPi * xy(i, 1));
    sums[0] += (u(i, 0) - exact) * (u(i, 0) - exact);
    sums[1] += exact * exact;
  }
  MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return std::sqrt(sums[0] / sums[1]);
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);
  const bool rank0 = runtime.world_rank() == 0;
  if (argc < 2 || argc > 4) {
    if (rank0)
      std::fprintf(stderr, "usage: mpirun -np N %s OUTPUT_DIR [STEPS [ERROR_BOUND]]\n", argv[0]);
    return 2;
  }
  const int64_t steps = argc > 2 ? std::atoll(argv[2]) : 4000;
  const double bound = argc > 3 ? std::atof(argv[3]) : 1e-2;

  meshtrain::RunConfig config;
  config.run.name = "pinn_poisson";
  config.run.seed = 1;
  config.run.output_dir = argv[1];
  config.mesh.axes = {{"dp", -1}};  // data parallel over every rank
  config.partition.preset = "dp";
  config.model.sizes = {2, 32, 32, 1};
  config.model.activation = meshtrain::Activation::tanh;  // smooth: the Laplacian is not 0
  config.data.source = meshtrain::DataSource::synthetic;  // unused: the rows are given below
  config.data.batch_size = 256;
  config.optimizer.kind = meshtrain::OptimizerKind::adamw;
  config.optimizer.lr = 3e-3;
  config.optimizer.schedule = meshtrain::LrScheduleKind::cosine;
  config.optimizer.min_lr = 1e-4;
  config.train.steps = steps;
  config.train.log_every = steps / 4 > 0 ? steps / 4 : 1;

  meshtrain::RunEvents events;
  if (rank0) {
    events.on_log = [](const meshtrain::LogEvent& e) {
      std::printf("step %lld/%lld loss %.3e\n", static_cast<long long>(e.step),
                  static_cast<long long>(e.total_steps), e.loss);
    };
  }
  std::string checkpoints;
  try {
    meshtrain::Dataset none;
    none.features = 2;
    none.target_width = 1;
    meshtrain::TrainingRun run(config, events, meshtrain::RunData{collocation_points(), none});
    meshtrain::RunPhysics physics;
    physics.loss.inputs = {0, 1};  // differentiate by x and y
    physics.loss.residuals = 1;
    physics.loss.weight = 1.0;
    physics.loss.residual = poisson_residual;
    physics.data_loss_weight = 0.0;  // no solution values: the physics alone
    run.set_physics(physics);
    const meshtrain::RunSummary summary = run.train();  // saves a checkpoint at the end
    if (rank0)
      std::printf("trained %lld steps in %.1f s\n", static_cast<long long>(summary.steps_run),
                  summary.wall_s);
    checkpoints = run.config().checkpoint.dir.empty() ? std::string(argv[1]) + "/checkpoints"
                                                      : run.config().checkpoint.dir;
  } catch (const meshtrain::AgreedError& e) {
    if (rank0) std::fprintf(stderr, "pinn_poisson: %s\n", e.what());
    return e.kind() == meshtrain::ErrorKind::bad_input ? 2 : 1;
  }

  try {
    const double error = grid_error(checkpoints, runtime);
    if (rank0) {
      std::printf("relative L2 error on a 101 x 101 grid: %.3e (bound %.1e)\n", error, bound);
    }
    return error < bound ? 0 : 1;
  } catch (const meshtrain::AgreedError& e) {
    if (rank0) std::fprintf(stderr, "pinn_poisson: %s\n", e.what());
    return e.kind() == meshtrain::ErrorKind::bad_input ? 2 : 1;
  }
}
