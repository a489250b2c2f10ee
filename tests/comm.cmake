# framework/ communicators, runtime and collective matmuls: every collective and every
# collective-matmul algorithm against a one-rank reference, on the world and on the groups
# of an fsdp x tp mesh; timeouts; workspace memory.
meshtrain_add_test(NAME comm_communicator_test SOURCES comm/communicator_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 120)
meshtrain_add_test(NAME comm_collective_matmul_test SOURCES comm/collective_matmul_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 180)
