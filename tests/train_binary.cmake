# model.loss = "binary_cross_entropy" from train to evaluate (AUC, log loss) at np 1 and 2, and
# targets outside [0, 1] refused (tests/train/binary_cross_entropy.sh says what it checks; the
# loss and the metrics on every mesh: layers_loss_test, layers_eval_metrics_test).
meshtrain_add_command_test(NAME train_binary_cross_entropy TIMEOUT 300
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/binary_cross_entropy.sh $<TARGET_FILE:meshtrain>
          ${MESHTRAIN_PYTHON} ${PROJECT_SOURCE_DIR} ${MESHTRAIN_MPIEXEC}
          ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(train_binary_cross_entropy PROPERTIES PROCESSORS 2)
