# partition/: pure C++ unit tests (no mpiexec needed).
meshtrain_add_test(NAME partition_test SOURCES partition/mesh_test.cpp LIBS meshtrain_partition)
