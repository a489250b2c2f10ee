# Online training (docs/online.md): one program whose ranks split into producers and a trainer
# (1 + 1, 1 + 2, 2 + 2): every row sent counted, the window and reservoir bounds exact, the run
# equal to the same rows from an HDF5 file, a shape mismatch one sentence on both sides. The
# timeout ends any hang of the rendezvous or the close.
meshtrain_add_test(NAME online_stream_test SOURCES online/stream_test.cpp LIBS meshtrain_run
                   NP 2 3 4 TIMEOUT 120)
