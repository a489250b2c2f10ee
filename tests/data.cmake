# framework/data: loading (Fashion-MNIST, synthetic, HDF5), schedule and evaluation as
# unit tests; batch slicing over meshes at several world sizes.
meshtrain_add_test(NAME data_test SOURCES data/data_test.cpp LIBS meshtrain_framework TIMEOUT 120)
meshtrain_add_test(NAME data_slicing_test SOURCES data/data_slicing_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 120)
