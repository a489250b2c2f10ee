# partition/: pure C++ unit tests (no mpiexec needed).
meshtrain_add_test(NAME partition_test
                   SOURCES partition/mesh_test.cpp partition/partition_spec_test.cpp
                           partition/planner_test.cpp partition/logical_axes_test.cpp
                           partition/sharding_picture_test.cpp
                           partition/linear_layout_test.cpp partition/cost_model_test.cpp
                   LIBS meshtrain_partition)
# `meshtrain plan` output (framework/train/plan_report).
meshtrain_add_test(NAME plan_print_test
                   SOURCES partition/plan_print_test.cpp
                   LIBS meshtrain_framework)
