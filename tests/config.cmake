# Config loading (framework/train/config.cpp) and the `meshtrain` command's argument and error
# handling: unit tests without mpiexec, command tests through tests/cli/expect_exit.sh.
meshtrain_add_test(NAME config_test SOURCES config/config_test.cpp LIBS meshtrain_framework)
# The source directory reaches the test through a generated header, not -D"...": nvcc_wrapper
# --host-only (below, for CUDA builds) does not pass a quoted definition through intact.
file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/generated/tests/source_dir.hpp
     CONTENT "#pragma once\n#define MESHTRAIN_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\"\n")
target_include_directories(config_test PRIVATE ${CMAKE_CURRENT_BINARY_DIR}/generated)
meshtrain_compile_on_host_only(${CMAKE_CURRENT_SOURCE_DIR}/config/config_test.cpp)
# One table per option (framework/core/choices.hpp) shared by the reader and the parsers;
# check_config for a RunConfig made in code.
meshtrain_add_test(NAME config_choices_test SOURCES config/choices_test.cpp LIBS meshtrain_framework)
# The hardware profile's TOML (framework/train/hardware_file.cpp): round trip and bad files.
meshtrain_add_test(NAME hardware_file_test SOURCES config/hardware_file_test.cpp
                   LIBS meshtrain_framework)
meshtrain_compile_on_host_only(${CMAKE_CURRENT_SOURCE_DIR}/config/hardware_file_test.cpp)
# Resuming checks the data order a checkpoint recorded (framework/train/resume.cpp).
# Not host-only: resume.hpp includes checkpoint.hpp and so Kokkos (no toml++).
meshtrain_add_test(NAME resume_check_test SOURCES config/resume_check_test.cpp
                   LIBS meshtrain_framework)

# `meshtrain plan` from the command line: bad input exits 2 with one sentence naming what is
# wrong; good input exits 0. Fixtures live in tests/cli/.
set(_cli ${CMAKE_CURRENT_SOURCE_DIR}/cli)
set(_configs ${PROJECT_SOURCE_DIR}/configs)
function(meshtrain_cli_test name status stderr_regex)
  meshtrain_add_command_test(NAME cli_${name} TIMEOUT 30
    COMMAND sh ${_cli}/expect_exit.sh ${status} ${stderr_regex} ${ARGN})
endfunction()
set(_meshtrain $<TARGET_FILE:meshtrain>)

meshtrain_cli_test(plan_malformed_toml 2
  "^meshtrain: error: .*malformed\\.toml:5:1: invalid TOML: "
  -- ${_meshtrain} plan ${_cli}/malformed.toml)
meshtrain_cli_test(plan_repeated_axis 2
  "^meshtrain: error: .*repeated_axis\\.toml:9: \\[partition\\] rule 1: spec .* names mesh axis 'tp' more than once"
  -- ${_meshtrain} plan ${_cli}/repeated_axis.toml)
meshtrain_cli_test(plan_bad_regex 2
  "^meshtrain: error: .*bad_regex\\.toml:8: \\[partition\\] rule 0: regex 'layers/\\(\\[0-9\\]\\+/weight' does not compile"
  -- ${_meshtrain} plan ${_cli}/bad_regex.toml)
meshtrain_cli_test(plan_world_does_not_fit_mesh 2
  "^meshtrain: error: .*mesh_2x4\\.toml \\[mesh\\]: .*dp=2.*tp=4.*world size is 7"
  -- ${_meshtrain} plan ${_cli}/mesh_2x4.toml --world 7)
meshtrain_cli_test(trace_report_without_trace 2
  "^meshtrain: error: '.*/no_such_run/trace' holds no rank-0\\.json: trace a run with \\[runtime\\] trace_steps"
  -- ${_meshtrain} trace-report ${CMAKE_CURRENT_BINARY_DIR}/no_such_run)
meshtrain_cli_test(plan_missing_config 2
  "^meshtrain: error: config file '.*no_such\\.toml' does not exist$"
  -- ${_meshtrain} plan ${_cli}/no_such.toml)
meshtrain_cli_test(plan_set_unknown_key 2
  "^meshtrain: error: .*override 'optimizer\\.lrr=1' names unknown key"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set optimizer.lrr=1)
meshtrain_cli_test(plan_set_bad_value 2
  "^meshtrain: error: .*fashion_mnist_dp\\.toml \\(--set train\\.steps=0\\): \\[train\\] steps must be at least 1, got 0$"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set train.steps=0)
meshtrain_cli_test(plan_set_bad_activation 2
  "^meshtrain: error: .*fashion_mnist_dp\\.toml \\(--set model\\.activation=\"siluu\"\\): \\[model\\] activation must be one of relu \\| tanh \\| gelu \\| gelu_erf \\| silu \\| sigmoid \\| none, got \"siluu\"$"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set "model.activation=\"siluu\"")
meshtrain_cli_test(plan_unknown_option 2 "^meshtrain: error: .*--frobnicate"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --frobnicate)
meshtrain_cli_test(plan_bad_world 2 "^meshtrain: error: --world"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --world 0)
meshtrain_cli_test(no_subcommand 2 "^meshtrain: error: .*subcommand" -- ${_meshtrain})
meshtrain_cli_test(unknown_subcommand 2
  "^meshtrain: error: unknown command 'frobnicate'. the commands are plan, trace-report, flight-report, train, inspect, calibrate, predict, export, evaluate, sweep \\(see meshtrain --help\\)$"
  -- ${_meshtrain} frobnicate checkpoint.h5)
meshtrain_cli_test(verbose_names_throw_site 2 "thrown at .*config\\.cpp:[0-9]+" --any-lines
  -- env MESHTRAIN_VERBOSE=1 ${_meshtrain} plan ${_cli}/no_such.toml)
meshtrain_cli_test(version 0 - --stdout "^meshtrain [0-9]+\\.[0-9]+\\.[0-9]+"
  -- ${_meshtrain} --version)
meshtrain_cli_test(plan_fsdp_tp_4096 0 - --stdout "4096 ranks"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_fsdp_tp.toml --world 4096)
meshtrain_cli_test(plan_set_overrides 0 - --stdout "\\[784, 256\\]"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set "model.sizes=[784, 256, 10]"
     --set run.output_dir=runs/x --world 2)
# MoE layers (issue 19): bad values name the key; the plan shows the layer and its all-to-alls.
meshtrain_cli_test(plan_moe_not_hidden 2
  "^meshtrain: error: .*\\[model\\] moe_layers entry 2 is not a hidden layer"
  -- ${_meshtrain} plan ${_configs}/moe_fashion_mnist.toml --set "model.moe_layers=[2]")
meshtrain_cli_test(plan_moe_top_k 2 "^meshtrain: error: .*\\[model\\] top_k = 9 must not exceed experts = 8"
  -- ${_meshtrain} plan ${_configs}/moe_fashion_mnist.toml --set model.top_k=9)
# top_k above the MoE layer's limit (partition/moe_limits.hpp's kMoeMaxTopK) with enough experts.
meshtrain_cli_test(plan_moe_top_k_limit 2
  "^meshtrain: error: .*\\[model\\] top_k = 17 must not exceed experts = 20 \\(nor 16\\)"
  -- ${_meshtrain} plan ${_configs}/moe_fashion_mnist.toml --set model.experts=20 --set model.top_k=17)
meshtrain_cli_test(plan_moe_experts_ep 2
  "^meshtrain: error: .*model\\.experts = 8 does not divide by the 3 ranks of the expert axes \\(ep\\)"
  -- ${_meshtrain} plan ${_configs}/moe_fashion_mnist.toml --world 3)
meshtrain_cli_test(plan_moe_layer 0 - --stdout "MoE in 512 -> out 256, 8 experts top-2, 4 per rank over \\(ep\\)"
  -- ${_meshtrain} plan ${_configs}/moe_fashion_mnist.toml --world 2)
# Planning needs no training length: a config without [train] plans (issue 9, bug 9).
meshtrain_cli_test(plan_without_train 0 - --stdout "^plan of .*no_train\\.toml for 4 ranks"
  -- ${_meshtrain} plan ${_cli}/no_train.toml --world 4)
meshtrain_add_command_test(NAME cli_plan_json TIMEOUT 30
  COMMAND sh ${_cli}/plan_json.sh ${_meshtrain} ${_configs}/fashion_mnist_fsdp_tp.toml 4
          layers/0/weight "[392, 256]")
meshtrain_add_command_test(NAME cli_plan_json_moe TIMEOUT 30
  COMMAND sh ${_cli}/plan_json.sh ${_meshtrain} ${_configs}/moe_fashion_mnist.toml 2
          layers/1/experts/weight "[4, 512, 256]")

# plan --hardware: a bad profile is one sentence naming file and key (exit 2); a missing one
# too; calibrate's profile (measured at 1, 2 and 4 ranks) reads back into plan --hardware.
meshtrain_cli_test(plan_bad_hardware 2 "bad_hardware.toml.*links.tp.bandwidth"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_tp.toml --hardware ${_cli}/bad_hardware.toml)
meshtrain_cli_test(plan_missing_hardware 2 "no_such_hardware.toml"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_tp.toml --hardware ${_cli}/no_such_hardware.toml)
foreach(case "1;dp" "2;fsdp_tp" "4;fsdp_tp")
  list(GET case 0 np)
  list(GET case 1 layout)
  meshtrain_add_command_test(NAME cli_calibrate_plan_np${np} TIMEOUT 120
    COMMAND sh ${_cli}/calibrate_plan.sh ${_meshtrain} ${_configs}/fashion_mnist_${layout}.toml
            ${np} ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
endforeach()

# kind = "residual_mlp" (docs/models.md): the keys of the other kind are refused naming the
# key, and so are depth 0 and an unknown norm; `meshtrain plan` of both residual
# configs lists exactly the model's parameters and its bytes add up (tests/cli/plan_residual.sh).
meshtrain_cli_test(residual_refuses_sizes 2
  "^meshtrain: error: .*\\[model\\] sizes is a key of kind = \"mlp\""
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_residual.toml --set "model.sizes=[784, 10]")
meshtrain_cli_test(mlp_refuses_width 2
  "^meshtrain: error: .*\\[model\\] width is a key of kind = \"residual_mlp\""
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set model.width=16)
# MoE blocks (model.moe_layers names blocks of a residual_mlp): an index that is not a block
# and dropout beside MoE blocks are one sentence naming the key and value; the plan shows the
# blocks' MoE layers and lists their parameters (router, experts/gate, up, down).
meshtrain_cli_test(residual_moe_not_a_block 2
  "^meshtrain: error: .*\\[model\\] moe_layers entry 4 is not a block: kind = \"residual_mlp\" names blocks 0 to 3 for depth = 4$"
  -- ${_meshtrain} plan ${_configs}/moe_residual_fashion_mnist.toml --set "model.moe_layers=[1, 4]")
meshtrain_cli_test(residual_moe_negative_block 2
  "^meshtrain: error: .*\\[model\\] moe_layers entry -1 is not a block"
  -- ${_meshtrain} plan ${_configs}/moe_residual_fashion_mnist.toml --set "model.moe_layers=[-1]")
meshtrain_cli_test(residual_moe_refuses_dropout 2
  "^meshtrain: error: .*\\[model\\] dropout = 0.1 is not supported with moe_layers in kind = \"residual_mlp\""
  -- ${_meshtrain} plan ${_configs}/moe_residual_fashion_mnist.toml --set model.dropout=0.1)
meshtrain_cli_test(plan_residual_moe_block 0 -
  --stdout "blocks/3: MoE in 256 -> swiglu hidden 512 -> out 256, 8 experts top-2, 4 per rank over \\(ep\\)"
  -- ${_meshtrain} plan ${_configs}/moe_residual_fashion_mnist.toml --world 2)
meshtrain_add_command_test(NAME cli_plan_residual_moe_ep2 TIMEOUT 30
  COMMAND sh ${_cli}/plan_residual.sh ${_meshtrain} ${MESHTRAIN_PYTHON}
          ${_configs}/moe_residual_fashion_mnist.toml 2)
meshtrain_add_command_test(NAME cli_plan_residual_moe_ep2_tp2_silu TIMEOUT 30
  COMMAND sh ${_cli}/plan_residual.sh ${_meshtrain} ${MESHTRAIN_PYTHON}
          ${_configs}/moe_residual_fashion_mnist.toml 4 --set mesh.ep=2 --set mesh.tp=2
          --set model.activation=silu)
meshtrain_cli_test(mlp_refuses_swiglu 2
  "^meshtrain: error: .*\\[model\\] activation must be one of .*got \"swiglu\""
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_dp.toml --set model.activation=swiglu)
meshtrain_cli_test(residual_refuses_depth_0 2
  "^meshtrain: error: .*\\[model\\] depth must be at least 1, got 0"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_residual.toml --set model.depth=0)
meshtrain_cli_test(residual_refuses_unknown_norm 2
  "^meshtrain: error: .*\\[model\\] norm must be one of layernorm \\| rmsnorm \\| none"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_residual.toml --set model.norm=batchnorm)
meshtrain_add_command_test(NAME cli_plan_residual_fashion_mnist TIMEOUT 30
  COMMAND sh ${_cli}/plan_residual.sh ${_meshtrain} ${MESHTRAIN_PYTHON}
          ${_configs}/fashion_mnist_residual.toml 4)
meshtrain_add_command_test(NAME cli_plan_residual_fashion_mnist_layernorm_tp4 TIMEOUT 30
  COMMAND sh ${_cli}/plan_residual.sh ${_meshtrain} ${MESHTRAIN_PYTHON}
          ${_configs}/fashion_mnist_residual.toml 8 --set model.norm=layernorm
          --set model.activation=silu --set mesh.tp=4)
meshtrain_add_command_test(NAME cli_plan_residual_regression_surrogate TIMEOUT 30
  COMMAND sh ${_cli}/plan_residual.sh ${_meshtrain} ${MESHTRAIN_PYTHON}
          ${_configs}/regression_surrogate.toml 2)
# A residual_mlp whose widths do not fit the data names its own key (model.inputs).
meshtrain_cli_test(residual_inputs_do_not_fit_data 2
  "^meshtrain: error: model\\.inputs = 785 does not match the 784 input features"
  -- ${_meshtrain} train ${_configs}/fashion_mnist_residual.toml --set model.inputs=785
     --set mesh.tp=1 --set run.output_dir=runs/residual_inputs_do_not_fit_data)
# The plan lists a residual_mlp's norms with their layout and collectives (statistics
# all-reduced over tp when the stream is split; the scale gradient over the batch axes).
meshtrain_cli_test(plan_residual_norms 0 -
  --stdout "blocks/0/norm: rmsnorm 256 features \\(split 128 over tp\\), statistics all-reduced over \\(tp\\)"
  -- ${_meshtrain} plan ${_configs}/fashion_mnist_residual.toml --world 4)

# One --set parser for every command (issue 36, defect 13): evaluate takes an override with
# spaces around '=' as predict, train and the config do, and gets as far as the checkpoint
# (which does not exist); evaluate used to refuse "data.batch_size " as a key it does not take.
meshtrain_cli_test(evaluate_set_with_spaces 2
  "^meshtrain: error: checkpoint '.*no_such_checkpoint\\.h5' does not exist"
  -- ${_meshtrain} evaluate ${CMAKE_CURRENT_BINARY_DIR}/no_such_checkpoint.h5
     --data ${CMAKE_CURRENT_BINARY_DIR}/no_such_data.h5 --set "data.batch_size = 8")
meshtrain_cli_test(predict_set_with_spaces 2
  "^meshtrain: error: checkpoint '.*no_such_checkpoint\\.h5' does not exist"
  -- ${_meshtrain} predict ${CMAKE_CURRENT_BINARY_DIR}/no_such_checkpoint.h5
     --input ${CMAKE_CURRENT_BINARY_DIR}/no_such_data.h5
     --output ${CMAKE_CURRENT_BINARY_DIR}/no_such_predictions.h5 --set "data.batch_size = 8")
meshtrain_cli_test(evaluate_set_refuses_model_key 2
  "^meshtrain: error: --set model\\.sizes is not allowed with evaluate: .* evaluate takes --set of mesh\\.\\*, partition\\.\\*, data\\.batch_size"
  -- ${_meshtrain} evaluate ${CMAKE_CURRENT_BINARY_DIR}/no_such_checkpoint.h5
     --data ${CMAKE_CURRENT_BINARY_DIR}/no_such_data.h5 --set "model.sizes = [4, 2]")
# An online run's checkpoint: evaluate resets its [stream] keys (they describe the stream, not
# --data), so a --set stream.* would be lost: it is refused, before the checkpoint is read.
meshtrain_cli_test(evaluate_set_refuses_stream_key 2
  "^meshtrain: error: --set stream\\.test_fraction is not allowed with evaluate: "
  -- ${_meshtrain} evaluate ${CMAKE_CURRENT_BINARY_DIR}/no_such_checkpoint.h5
     --data ${CMAKE_CURRENT_BINARY_DIR}/no_such_data.h5 --set "stream.test_fraction = 0.5")
# --set train.steps replaces the file's train.epochs, and the run says so in one line (issue
# 36, defect 21).
meshtrain_cli_test(train_steps_replaces_epochs 0 -
  --stdout "^note: --set train\\.steps = 2 replaces train\\.epochs = 10 of .*fashion_mnist_dp\\.toml$"
  -- ${_meshtrain} train ${_configs}/fashion_mnist_dp.toml --set "model.sizes=[784, 16, 10]"
     --set train.steps=2 --set train.log_every=1
     --set run.output_dir=${CMAKE_CURRENT_BINARY_DIR}/cli_runs/train_steps_replaces_epochs)
# kind = "dlrm" (docs/recsys.md): bottom, top, [[model.tables]], interaction and
# data.sparse_key read and written back; each inconsistency refused in one sentence.
meshtrain_add_test(NAME config_dlrm_test SOURCES config/dlrm_config_test.cpp LIBS meshtrain_framework)
# kind = "dlrm" (docs/recsys.md): `meshtrain plan` lists the tables (the large one row-wise over
# fsdp, the small one replicated under min_sharding_size); `meshtrain train` opens its data (a
# missing file named in one sentence; tests/recsys.cmake trains it); `meshtrain sweep`, which does
# not serve the kind yet, refuses it in one sentence (run/dlrm_run.hpp require_command_builds); a
# top[0] that is not the interaction's width names it.
meshtrain_cli_test(plan_dlrm 0 -
  --stdout "embeddings/large/weight"
  -- ${_meshtrain} plan ${_cli}/dlrm.toml --world 2)
meshtrain_cli_test(train_dlrm_missing_data 2
  "^meshtrain: error: cannot read the HDF5 data file 'data/recsys/train\\.h5': No such file"
  -- ${_meshtrain} train ${_cli}/dlrm.toml)
# A 16-bit policy is refused by name (it was trained in fp32 under a checkpoint saying bf16).
meshtrain_cli_test(train_dlrm_bf16_refused 2
  "^meshtrain: error: .*dlrm\\.toml: mixed_precision\\.param_dtype = \"bf16\": model\\.kind = \"dlrm\" is not trained with it yet"
  -- ${_meshtrain} train ${_cli}/dlrm.toml --set "mixed_precision.param_dtype=\"bf16\"")
meshtrain_cli_test(sweep_dlrm_refused 2
  "^meshtrain: error: `meshtrain sweep` does not serve model\\.kind = \"dlrm\" yet"
  -- ${_meshtrain} sweep ${_cli}/dlrm.toml --grid optimizer.lr=1e-3,2e-3)
meshtrain_cli_test(dlrm_wrong_top 2
  "^meshtrain: error: .*\\[model\\] top starts with 20 but interaction = \"dot\" of d = 8 and 3 tables gives 14 features .*top = \\[14, \\.\\.\\.\\]$"
  -- ${_meshtrain} plan ${_cli}/dlrm.toml --set "model.top=[20, 1]")
