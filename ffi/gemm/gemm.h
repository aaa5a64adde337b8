// Host-side contract of the GEMM that both ops run (gemm_kernel.cuh): its block extents, the block
// order inside a group of tile rows, the CTA work split (with the split tail), the block
// coordinates an op's schedule hands the kernel, and a launch prepared once and enqueued many
// times. No kernel syntax; names no op.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "comm/protocol.h"

namespace entwine {

// A GEMM block is BLOCK_M x block_n x BLOCK_K (block_n: 128 or 256, per instantiation).
constexpr int kBlockM = 128;  // two math warpgroups of 64 rows each
// BLOCK_K is one 128-byte TMA swizzle row of the input type: 64 2-byte elements, 128 FP8 ones.
constexpr int block_k(DType input) { return 128 / element_bytes(input); }
// K is padded to this (zeros add nothing): 16-byte rows for TMA.
constexpr int align_k(DType input) { return 16 / element_bytes(input); }
// FP8 operands run 128-wide blocks only: the mainloop adds the tensor cores' partial sums into a
// second fp32 accumulator (gemm_kernel.cuh), and two 64 x 256 fp32 fragments per math thread
// would not fit its registers.
constexpr int kFp8BlockN = 128;

// How FP8 operands are dequantised. kTensor: one factor per operand, applied to a block's finished
// sum (the schedule's alpha). kBlock (DeepSeek-V3 / TransformerEngine block scaling): x has one
// scale per row and kScaleBlock-wide K block, w_t one per kScaleBlock x kScaleBlock block, applied
// by the mainloop to each k-tile's partial sum (a k-tile is one K block: BLOCK_K == kScaleBlock).
// kSlice (ag_gemm's contraction layout with a scale per shard): per tensor, but x's factor changes
// from one K slice to the next, so the mainloop runs once per slice and scales its partial sums by
// the slice's factor (the schedule's k_slice); alpha is w's alone. Its own instantiation, so that the
// kTensor kernels keep their code (docs/design.md, "FP8 operands").
enum class Scaling : int32_t { kTensor = 0, kBlock = 1, kSlice = 2 };
constexpr int kScaleBlock = 128;

// Production order of the GEMM blocks of one group of tile rows (a partition, a chunk): groups of
// `raster_rows` tile rows, each group visited column by column, so the blocks in flight at once
// share rows of A and columns of B in L2. Block i -> (tile row, block column).
struct TileOrder {
  int32_t m_blocks, n_blocks, raster_rows;
#ifdef __CUDACC__
  __host__ __device__
#endif
  void block(int32_t i, int32_t& tile_m, int32_t& n_block) const {
    int32_t const per_group = raster_rows * n_blocks;
    int32_t const group = i / per_group, j = i % per_group;
    int32_t const rows = m_blocks - group * raster_rows < raster_rows ? m_blocks - group * raster_rows : raster_rows;
    tile_m = group * raster_rows + j % rows;
    n_block = j / rows;
  }
};

// A schedule's block p: the owner (gemm_rs: the partition; ag_gemm: the source shard), the tile
// row inside it and the block column.
struct BlockCoord {
  int owner, tile_m, n_block;
};

// The GEMM grid and its work split for one call, part of each op's plan.
struct WorkSchedule {
  int32_t num_blocks;         // GEMM blocks of the call
  int32_t grid;               // CTAs: num_blocks, or a persistent grid
  int32_t k_tiles;            // k-tiles per block: TMA zero-fills the K tail
  int32_t split_first_block;  // blocks from here on are split in K over the grid (num_blocks: none)
};

// Split tail of a persistent grid (gemm_kernel.cuh): the last one-and-a-fraction waves of blocks
// are divided evenly in K over the grid, and a block computed in two pieces by two CTAs meets in
// one slot of a workspace: an arrival counter, a ready sequence and an fp32 partial block. One
// workspace per stream (calls on one stream run one after the other), zeroed once at allocation;
// the counters are never reset (each call adds two arrivals per used slot).
constexpr int kSplitSlots = 160;  // a grid of G CTAs uses slots 0 .. G-2: grids above 161 do not split
constexpr size_t kSplitCountersBytes = 4096;  // u32 arrive[kSplitSlots], u32 ready[kSplitSlots]
constexpr size_t kSplitSlotBytes = size_t(kBlockM) * 256 * sizeof(float);  // the widest block, fp32
constexpr size_t kSplitWorkspaceBytes = kSplitCountersBytes + kSplitSlots * kSplitSlotBytes;

// One GEMM launch with its kernel parameters built (TMA descriptors included: each descriptor's
// encoding looks up its driver entry point, microseconds of host time), so that a handler can build
// them once per call site and buffers and enqueue them on every call. Filled by an op's
// prepare_gemm (generated dispatch); the parameters are the instantiation's, behind `launch`.
struct PreparedGemm {
  // Above every instantiation's Params (static_assert). A schedule whose B is a group of operands
  // holds 640 bytes of mainloop parameters (TMA descriptors) per further operand and A (ag_gemm:
  // 5.5 KB for 4 weights; block-scaled kernels take one weight, with a scale descriptor more per
  // mainloop); kernel parameters above 4 KB need CUDA 12.1, which sm_90a builds have.
  static constexpr size_t kParamsBytes = 6144;
  alignas(128) unsigned char params[kParamsBytes];
  cudaError_t (*launch)(void const* params, cudaStream_t stream, bool dependent) = nullptr;
  // dependent: as the programmatic dependent of the stream's previous kernel (gemm_kernel.cuh).
  cudaError_t enqueue(cudaStream_t stream, bool dependent = false) const { return launch(params, stream, dependent); }
};

}  // namespace entwine
