// The MoE schedules' block order over ragged segments. With the received counts, the blocks that
// hold rows come first, segment by segment in the schedule's order, then the empty ones: a
// persistent grid deals its blocks out round-robin (p = CTA + i * grid), so the blocks with rows
// spread evenly over the CTAs whatever each segment's count (in the plain order, a segment's
// non-empty tile rows would fall to the few CTAs whose index matches them).
#pragma once

#include <cstdint>

#include "gemm/gemm.h"

namespace entwine::moe {

// Tile rows of a segment of `seg_tiles` that hold some of its `rows` (clamped to [0, seg_tiles]).
__device__ inline int tiles_with_rows(int32_t rows, int seg_tiles) {
  int const tiles = rows <= 0 ? 0 : (rows + kBlockM - 1) / kBlockM;
  return tiles < seg_tiles ? tiles : seg_tiles;
}

// Block p of `segments` segments of order.m_blocks x order.n_blocks blocks each; owner_of(j) is the
// j-th segment's owner in the schedule's order. received[owner] (nullptr: every segment full): the
// rows of each segment; a block is empty when its first row is at or past them (the schedules'
// empty() hook). A bijection of [0, segments * blocks per segment).
template <class OwnerOf>
__device__ BlockCoord ragged_block(int p, int segments, TileOrder const& order, const int32_t* received,
                                   OwnerOf owner_of) {
  int const seg_tiles = order.m_blocks, n_blocks = order.n_blocks;
  if (received == nullptr) {
    int const per_seg = seg_tiles * n_blocks;
    BlockCoord c{owner_of(p / per_seg), 0, 0};
    order.block(p % per_seg, c.tile_m, c.n_block);
    return c;
  }
  int q = p;
  // The blocks with rows, each segment's in its raster order over its own tile rows.
  for (int j = 0; j < segments; ++j) {
    int const owner = owner_of(j);
    int const tiles = tiles_with_rows(received[owner], seg_tiles);
    if (q < tiles * n_blocks) {
      BlockCoord c{owner, 0, 0};
      TileOrder{tiles, n_blocks, order.raster_rows}.block(q, c.tile_m, c.n_block);
      return c;
    }
    q -= tiles * n_blocks;
  }
  // Then the empty blocks (no loads, no math; the dispatch stores zeros, the combine nothing).
  for (int j = 0; j < segments; ++j) {
    int const owner = owner_of(j);
    int const tiles = tiles_with_rows(received[owner], seg_tiles), empty_rows = seg_tiles - tiles;
    if (q < empty_rows * n_blocks) return BlockCoord{owner, tiles + q % empty_rows, q / empty_rows};
    q -= empty_rows * n_blocks;
  }
  return BlockCoord{owner_of(0), 0, 0};  // p past the call's blocks: never asked
}

}  // namespace entwine::moe
