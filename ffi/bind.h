// How an op joins the nanobind module entwine_jax._entwine (module.cc, one line per op): its
// bind() adds the op's Python API (target-name constant, plan function) to the module, appends its
// FFI targets to `targets` and registers its hooks with the communicators (comm::register_op).
#pragma once

#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "comm/protocol.h"

namespace entwine {

// An FFI target: what registrations() hands to jax.ffi.register_ffi_target; fp8_targets() lists
// those whose operands are FP8.
struct FfiTarget {
  std::string name;
  void* handler;  // XLA_FFI_Handler*
  bool fp8;
};
using FfiTargets = std::vector<FfiTarget>;

// The kernels' type of an FP8 call's x, from its numpy dtype name (the FP8 plans' x_dtype).
inline DType fp8_input_dtype(std::string const& name) {
  if (name == "float8_e4m3fn") return DType::kE4M3;
  if (name == "float8_e5m2") return DType::kE5M2;
  throw nanobind::value_error(("x_dtype must be float8_e4m3fn or float8_e5m2, got " + name).c_str());
}

// The violated rule of a plan, or None.
inline nanobind::object rule_or_none(const char* rule) {
  return rule ? nanobind::cast(std::string(rule)) : nanobind::none();
}

}  // namespace entwine
