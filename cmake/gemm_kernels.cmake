# The GEMM instantiations, from one table: each row "op input output block_n" becomes one generated
# translation unit (one CUTLASS instantiation: ~35 s and ~3.5 GB to compile, so one per file), and
# each op's rows become its generated dispatch, <op>::prepare_gemm, launch_gemm and prepare_gemms (declared
# in ffi/<op>/<op>.h; the schedule is entwine::<op>::GemmSchedule in ffi/<op>/gemm_schedule.cuh).
# Adding a variant is adding a row; input and output are DTypes of ffi/comm/protocol.h, lower-case.
# An op with a second GEMM names it "<op>.<schedule>": entwine::<op>::<schedule>::GemmSchedule in
# ffi/<op>/<schedule>_schedule.cuh, its dispatch declared in ffi/<op>/<op>.h in that namespace.
# FP8 inputs (e4m3: both operands e4m3; e5m2: x e5m2, w_t e4m3) run 128-wide blocks only
# (ffi/gemm/gemm.h, kFp8BlockN). An optional fifth field is the FP8 scaling (ffi/gemm/gemm.h,
# Scaling): "tensor" (the default), "block" or "slice".
set(ENTWINE_GEMM_TABLE
  "gemm_rs bf16 bf16 128"
  "gemm_rs bf16 bf16 256"
  "gemm_rs fp16 fp16 128"
  "gemm_rs fp16 fp16 256"
  "gemm_rs e4m3 bf16 128"
  "gemm_rs e4m3 fp16 128"
  "gemm_rs e5m2 bf16 128"
  "gemm_rs e5m2 fp16 128"
  "gemm_rs e4m3 bf16 128 block"
  "gemm_rs e4m3 fp16 128 block"
  "gemm_rs e5m2 bf16 128 block"
  "gemm_rs e5m2 fp16 128 block"
  "ag_gemm bf16 bf16 128"
  "ag_gemm bf16 bf16 256"
  "ag_gemm fp16 fp16 128"
  "ag_gemm fp16 fp16 256"
  "ag_gemm e4m3 bf16 128"
  "ag_gemm e4m3 fp16 128"
  "ag_gemm e5m2 bf16 128"
  "ag_gemm e5m2 fp16 128"
  "ag_gemm e4m3 bf16 128 block"
  "ag_gemm e4m3 fp16 128 block"
  "ag_gemm e5m2 bf16 128 block"
  "ag_gemm e5m2 fp16 128 block"
  "ag_gemm e4m3 bf16 128 slice"
  "ag_gemm e4m3 fp16 128 slice"
  "ag_gemm e5m2 bf16 128 slice"
  "ag_gemm e5m2 fp16 128 slice"
  "moe bf16 bf16 128"
  "moe bf16 bf16 256"
  "moe fp16 fp16 128"
  "moe fp16 fp16 256"
  "moe e4m3 bf16 128"
  "moe e4m3 fp16 128"
  "moe e5m2 bf16 128"
  "moe e5m2 fp16 128"
  "moe.combine bf16 bf16 128"
  "moe.combine bf16 bf16 256"
  "moe.combine fp16 fp16 128"
  "moe.combine fp16 fp16 256"
  "moe.combine e4m3 bf16 128"
  "moe.combine e4m3 fp16 128"
  "moe.combine e5m2 bf16 128"
  "moe.combine e5m2 fp16 128"
  "moe.wgrad bf16 bf16 128"
  "moe.wgrad bf16 bf16 256"
  "moe.wgrad fp16 fp16 128"
  "moe.wgrad fp16 fp16 256")

# Sets ENTWINE_GEMM_SOURCES to the generated files (instances and dispatches).
function(entwine_generate_gemm_kernels out_dir)
  set(sources "")
  set(ops "")
  foreach(row IN LISTS ENTWINE_GEMM_TABLE)
    separate_arguments(fields UNIX_COMMAND "${row}")
    list(GET fields 0 OP_FIELD)
    # "<op>" or "<op>.<schedule>": the folder, the schedule's header and namespace, the generated files' folder.
    string(REPLACE "." ";" op_parts "${OP_FIELD}")
    list(GET op_parts 0 FOLDER)
    list(LENGTH op_parts op_part_count)
    if(op_part_count GREATER 1)
      list(GET op_parts 1 SCHEDULE)
      set(SCHEDULE_HEADER "${FOLDER}/${SCHEDULE}_schedule.cuh")
      set(NAMESPACE "${FOLDER}::${SCHEDULE}")
      set(OP "${FOLDER}_${SCHEDULE}")
    else()
      set(SCHEDULE_HEADER "${FOLDER}/gemm_schedule.cuh")
      set(NAMESPACE "${FOLDER}")
      set(OP "${FOLDER}")
    endif()
    set(HEADER "${FOLDER}/${FOLDER}.h")
    list(GET fields 1 INPUT)
    list(GET fields 2 OUTPUT)
    list(GET fields 3 BLOCK_N)
    set(SCALING "tensor")
    list(LENGTH fields field_count)
    if(field_count GREATER 4)
      list(GET fields 4 SCALING)
    endif()
    if(NOT SCALING MATCHES "^(tensor|block|slice)$")
      message(FATAL_ERROR "gemm kernel table row \"${row}\": scaling must be tensor, block or slice")
    endif()
    string(TOUPPER "${INPUT}" INPUT_UPPER)
    string(TOUPPER "${OUTPUT}" OUTPUT_UPPER)
    set(NAME "${INPUT}_${OUTPUT}_n${BLOCK_N}")
    if(SCALING STREQUAL "block")
      set(NAME "${NAME}_block")
      set(SCALING_ENUM "Scaling::kBlock")
    elseif(SCALING STREQUAL "slice")
      set(NAME "${NAME}_slice")
      set(SCALING_ENUM "Scaling::kSlice")
    else()
      set(SCALING_ENUM "Scaling::kTensor")
    endif()
    set(INPUT_ENUM "DType::k${INPUT_UPPER}")
    set(OUTPUT_ENUM "DType::k${OUTPUT_UPPER}")
    configure_file("${CMAKE_CURRENT_FUNCTION_LIST_DIR}/gemm_instance.cu.in" "${out_dir}/${OP}/gemm_${NAME}.cu" @ONLY)
    list(APPEND sources "${out_dir}/${OP}/gemm_${NAME}.cu")
    if(NOT OP IN_LIST ops)
      list(APPEND ops "${OP}")
      set(HEADER_${OP} "${HEADER}")
      set(NAMESPACE_${OP} "${NAMESPACE}")
      set(DECLS_${OP} "")
      set(CASES_${OP} "")
      set(PREPARES_${OP} "")
    endif()
    string(APPEND DECLS_${OP}
      "cudaError_t prepare_${NAME}();\n"
      "void prepare_launch_${NAME}(GemmPlan const& plan, GemmArgs const& args, PreparedGemm* out);\n")
    string(APPEND CASES_${OP}
      "  if (input == ${INPUT_ENUM} && output == ${OUTPUT_ENUM} && plan.config.block_n == ${BLOCK_N} &&\n"
      "      plan.scaling == ${SCALING_ENUM}) {\n"
      "    prepare_launch_${NAME}(plan, args, out);\n"
      "    return cudaSuccess;\n"
      "  }\n")
    string(APPEND PREPARES_${OP} "prepare_${NAME}, ")
  endforeach()
  foreach(OP IN LISTS ops)
    set(HEADER "${HEADER_${OP}}")
    set(NAMESPACE "${NAMESPACE_${OP}}")
    set(DECLS "${DECLS_${OP}}")
    set(CASES "${CASES_${OP}}")
    string(REGEX REPLACE ", $" "" PREPARES "${PREPARES_${OP}}")
    configure_file("${CMAKE_CURRENT_FUNCTION_LIST_DIR}/gemm_dispatch.cc.in" "${out_dir}/${OP}/gemm_dispatch.cc" @ONLY)
    list(APPEND sources "${out_dir}/${OP}/gemm_dispatch.cc")
  endforeach()
  set(ENTWINE_GEMM_SOURCES "${sources}" PARENT_SCOPE)
endfunction()
