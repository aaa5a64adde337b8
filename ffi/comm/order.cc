// XLA FFI target `entwine_order`: the link of the fused calls' order token (Python's _ordered.py)
// from one fused call to the next. It takes the token and one result of the call just made and
// returns the next token, so the next fused call depends on this one's result; it does nothing at
// run time. The fused calls themselves take the token but return only arrays: XLA 0.11.2's GPU
// fusion cost analysis aborts on a fusion operand that is a tuple holding a token, which a fused
// call inside a loop body returning (result, token) produced.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error OrderImpl(ffi::AnyBuffer, ffi::Token, ffi::Result<ffi::Token>) { return ffi::Error::Success(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntwineOrder, OrderImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // a result of the fused call just made
                                  .Arg<ffi::Token>()      // the order token before it
                                  .Ret<ffi::Token>(),     // the order token after it
                              {ffi::Traits::kCmdBufferCompatible});
