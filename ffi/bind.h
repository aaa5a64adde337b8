// How an op joins the nanobind module entwine_jax._entwine (module.cc, one line per op): its
// bind() adds the op's Python API (target-name constant, plan function) to the module, appends its
// FFI targets to `targets` and registers its hooks with the communicators (comm::register_op).
#pragma once

#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

namespace entwine {

// An FFI target: what registrations() hands to jax.ffi.register_ffi_target; fp8_targets() lists
// those whose operands are FP8.
struct FfiTarget {
  std::string name;
  void* handler;  // XLA_FFI_Handler*
  bool fp8;
};
using FfiTargets = std::vector<FfiTarget>;

// The violated rule of a plan, or None.
inline nanobind::object rule_or_none(const char* rule) {
  return rule ? nanobind::cast(std::string(rule)) : nanobind::none();
}

}  // namespace entwine
