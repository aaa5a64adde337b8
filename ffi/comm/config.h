// How an op lists its config once: as a macro of X(type, name, default) rows in the op's header,
// which these helpers expand into the struct's members, its printable form and (handler_util.h)
// its XLA FFI dictionary-attribute decoding, so the three cannot drift apart.
#pragma once

#include <string>

// One member of the config struct, with its default.
#define ENTWINE_CONFIG_MEMBER(type, name, value) type name = value;

// Appends "name=value" to std::string `out_`, reading the member from `config_` (see
// ENTWINE_CONFIG_STRING).
#define ENTWINE_CONFIG_APPEND(type, name, value) \
  out_ += std::string(out_.size() > 1 ? ", " : "") + #name "=" + std::to_string(config_.name);

// "{block_n=256, ...}": the printable form of a config whose field list is FIELDS.
#define ENTWINE_CONFIG_STRING(config, FIELDS) \
  [&] {                                       \
    auto const& config_ = (config);           \
    std::string out_ = "{";                   \
    FIELDS(ENTWINE_CONFIG_APPEND)             \
    return out_ + "}";                        \
  }()
