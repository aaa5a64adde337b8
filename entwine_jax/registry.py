# The ops: one line each. Shared code (the census, the pairing) iterates these specs (each op's op
# contract, entwine_jax.opspec) instead of naming an op; adding an op adds its line here.
from entwine_jax import opspec
from entwine_jax.ag_gemm.op import SPEC as _AG_GEMM
from entwine_jax.gemm_rs.op import SPEC as _GEMM_RS
from entwine_jax.moe.op import COMBINE_SPEC as _MOE_COMBINE
from entwine_jax.moe.op import DISPATCH_SPEC as _MOE_DISPATCH

OPS: dict[str, opspec.OpSpec] = {spec.name: spec for spec in (
    _GEMM_RS,
    _AG_GEMM,
    _MOE_DISPATCH, _MOE_COMBINE,
)}


def backward_of(spec: opspec.OpSpec) -> opspec.OpSpec:
    """The op whose call is `spec`'s dx (in the same layout)."""
    return OPS[spec.backward]
