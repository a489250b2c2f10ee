# partition/: pure C++ unit tests (no mpiexec needed).
meshtrain_add_test(NAME partition_test
                   SOURCES partition/mesh_test.cpp partition/partition_spec_test.cpp
                           partition/planner_test.cpp partition/logical_axes_test.cpp
                           partition/sharding_picture_test.cpp
                           partition/linear_layout_test.cpp partition/cost_model_test.cpp
                           partition/embedding_layout_test.cpp
                   LIBS meshtrain_partition)
# `meshtrain plan` output (framework/train/plan_report).
meshtrain_add_test(NAME plan_print_test
                   SOURCES partition/plan_print_test.cpp
                   LIBS meshtrain_framework)
# Every partition preset x model kind (mlp, residual_mlp, each with and without MoE) x a small
# and a large size (residual_mlp also one whose input projection is its large tensor), with the
# default min_sharding_size: planned as `meshtrain plan` plans it and trained 2 steps against a
# one-rank run (issue 36: a preset that plans must train).
meshtrain_add_test(NAME partition_preset_grid_test SOURCES partition/preset_grid_test.cpp
                   LIBS meshtrain_run NP 2 4 TIMEOUT 240)
