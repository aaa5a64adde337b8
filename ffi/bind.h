// How an op joins the nanobind module entwine_jax._entwine (module.cc, one line per op): its
// bind() adds the op's Python API (target-name constant, plan function) to the module, appends its
// FFI targets to `targets` and registers its hooks with the communicators (comm::register_op).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

namespace entwine {

// {target name, XLA_FFI_Handler*}: what registrations() hands to jax.ffi.register_ffi_target.
using FfiTargets = std::vector<std::pair<std::string, void*>>;

// The violated rule of a plan, or None.
inline nanobind::object rule_or_none(const char* rule) {
  return rule ? nanobind::cast(std::string(rule)) : nanobind::none();
}

}  // namespace entwine
