// The MoE schedules' block order (moe/moe.h: segment_block, lead_tiles, past_received) checked on a
// CPU over seeded random problems, as the kernels' roles walk it. Built and run by
// tests/test_segment_order.py; prints "ok <cases>" or the first violation, and exits nonzero on one.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "moe/moe.h"

namespace {

using entwine::BlockCoord;
using entwine::kBlockM;
using entwine::SegmentCursor;
using entwine::TileOrder;

int failures = 0;

// The schedule's segment order as segment_block asks it (host and device callable, as the kernels'
// own): group g's j-th segment is owners[start[g] + j].
struct Groups {
  const int* owners;
  const int* start;  // [count + 1]
  int count;
  __host__ __device__ int size(int g) const { return start[g + 1] - start[g]; }
  __host__ __device__ int owner(int g, int j) const { return owners[start[g] + j]; }
};

void fail(const char* what, int segments, int seg_tiles, int n_blocks, int p) {
  if (failures++ < 5) {
    std::printf("FAIL %s (segments %d, seg_tiles %d, n_blocks %d, p %d)\n", what, segments, seg_tiles, n_blocks, p);
  }
}

// One problem: `owners` is the schedule's segment order (a permutation of 0 .. segments), group g
// its segments start[g] .. start[g + 1], received the rows per owner (empty: every segment full),
// raster the plan's raster rows (clamped to the largest group's tile rows, as the plan does), grid
// the CTAs.
void check(std::vector<int> const& owners, std::vector<int> const& start, std::vector<int32_t> const& received,
           int seg_tiles, int n_blocks, int raster, int grid) {
  int const segments = int(owners.size()), count = int(start.size()) - 1;
  int const blocks = segments * seg_tiles * n_blocks;
  const int32_t* rows = received.empty() ? nullptr : received.data();
  int largest = 0;
  for (int g = 0; g < count; ++g) largest = std::max(largest, start[g + 1] - start[g]);
  int const stack_tiles = largest * seg_tiles;
  TileOrder const order{stack_tiles, n_blocks, raster < stack_tiles ? raster : stack_tiles};
  Groups const groups{owners.data(), start.data(), count};

  // Every position from a fresh cursor; every block exactly once.
  std::vector<BlockCoord> at(blocks);
  std::vector<int> seen(blocks, 0);
  for (int p = 0; p < blocks; ++p) {
    SegmentCursor fresh;
    BlockCoord const c = entwine::segment_block(p, fresh, groups, rows, seg_tiles, order);
    at[p] = c;
    if (c.owner < 0 || c.owner >= segments || c.tile_m < 0 || c.tile_m >= seg_tiles || c.n_block < 0 ||
        c.n_block >= n_blocks) {
      fail("block out of range", segments, seg_tiles, n_blocks, p);
      return;
    }
    ++seen[(c.owner * seg_tiles + c.tile_m) * n_blocks + c.n_block];
  }
  for (int b = 0; b < blocks; ++b) {
    if (seen[b] != 1) fail("a block not visited exactly once", segments, seg_tiles, n_blocks, b);
  }

  // The lead blocks (every tile row with rows, at least one per segment) come first, then the rest,
  // all of them empty; each segment's lead blocks total lead_tiles * n_blocks.
  int lead_blocks = 0;
  for (int s = 0; s < segments; ++s) {
    int const lead = entwine::lead_tiles(rows, s, seg_tiles);
    // At least one: an empty segment's flag is waited for (dispatch) or released (combine) there.
    if (lead < 1 || lead > seg_tiles) fail("lead tile rows out of [1, seg_tiles]", segments, seg_tiles, n_blocks, s);
    lead_blocks += lead * n_blocks;
  }
  for (int p = 0; p < blocks; ++p) {
    bool const lead = at[p].tile_m < entwine::lead_tiles(rows, at[p].owner, seg_tiles);
    if (lead != (p < lead_blocks)) fail("lead blocks not first", segments, seg_tiles, n_blocks, p);
    bool const past = entwine::past_received(rows, at[p]);
    if (!lead && !past) fail("a block with rows after the leads", segments, seg_tiles, n_blocks, p);
    bool const has_rows = rows == nullptr || at[p].tile_m * kBlockM < rows[at[p].owner];
    if (has_rows == past) fail("past_received disagrees", segments, seg_tiles, n_blocks, p);
  }

  // Full segments: the group order, each group's segments stacked in order and run in the plan's
  // raster over the stack.
  if (rows == nullptr) {
    int p = 0;
    for (int g = 0; g < count; ++g) {
      int const tiles = groups.size(g) * seg_tiles;
      TileOrder const stack{tiles, n_blocks, order.raster_rows};
      for (int i = 0; i < tiles * n_blocks; ++i, ++p) {
        int tile = 0, n_block = 0;
        stack.block(i, tile, n_block);
        BlockCoord const want{groups.owner(g, tile / seg_tiles), tile % seg_tiles, n_block};
        if (want.owner != at[p].owner || want.tile_m != at[p].tile_m || want.n_block != at[p].n_block) {
          fail("full segments out of group order", segments, seg_tiles, n_blocks, p);
        }
      }
    }
  }

  // In either pass a group's blocks are consecutive positions, and a group's segments keep their
  // order inside a stack: within one block column, a segment's tile rows come after those of the
  // segments before it in the group, in increasing tile row.
  std::vector<int> group_of(segments), index_in_group(segments);
  for (int g = 0; g < count; ++g) {
    for (int j = 0; j < groups.size(g); ++j) {
      group_of[groups.owner(g, j)] = g;
      index_in_group[groups.owner(g, j)] = j;
    }
  }
  for (int p = 1; p < blocks; ++p) {
    BlockCoord const a = at[p - 1], b = at[p];
    bool const a_lead = p - 1 < lead_blocks, b_lead = p < lead_blocks;
    if (a_lead == b_lead && group_of[b.owner] < group_of[a.owner]) {
      fail("a group's blocks not consecutive", segments, seg_tiles, n_blocks, p);
    }
    if (a_lead == b_lead && group_of[a.owner] == group_of[b.owner] && a.n_block == b.n_block &&
        (index_in_group[b.owner] < index_in_group[a.owner] ||
         (a.owner == b.owner && b.tile_m <= a.tile_m))) {
      fail("a stack out of segment order", segments, seg_tiles, n_blocks, p);
    }
  }

  // Each CTA's role walks its positions cta, cta + grid, ... with one cursor (WorkIter), then a
  // smaller position restarts the walk: the same blocks as fresh cursors.
  for (int cta = 0; cta < grid; ++cta) {
    SegmentCursor cursor;
    for (int p = cta; p < blocks; p += grid) {
      BlockCoord const c = entwine::segment_block(p, cursor, groups, rows, seg_tiles, order);
      if (c.owner != at[p].owner || c.tile_m != at[p].tile_m || c.n_block != at[p].n_block) {
        fail("a walking cursor disagrees", segments, seg_tiles, n_blocks, p);
      }
    }
    if (cta < blocks) {
      BlockCoord const c = entwine::segment_block(cta, cursor, groups, rows, seg_tiles, order);
      if (c.owner != at[cta].owner || c.tile_m != at[cta].tile_m || c.n_block != at[cta].n_block) {
        fail("a restarted cursor disagrees", segments, seg_tiles, n_blocks, cta);
      }
    }
  }

  // The round-robin deal gives every CTA an even share of the blocks with rows when no segment is
  // empty (they are then exactly the lead blocks, a prefix of the positions).
  bool none_empty = rows != nullptr;
  for (int s = 0; rows != nullptr && s < segments; ++s) none_empty = none_empty && rows[s] > 0;
  if (none_empty) {
    std::vector<int> share(grid, 0);
    for (int p = 0; p < blocks; ++p) {
      if (!entwine::past_received(rows, at[p])) ++share[p % grid];
    }
    int lo = share[0], hi = share[0];
    for (int v : share) {
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    if (hi - lo > 1) fail("an uneven share of the blocks with rows", segments, seg_tiles, n_blocks, hi - lo);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(20261205);
  auto uniform = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    // Groups of 1 to 8 segments (the schedules': one, or an expert's W - 1 peers).
    int const segments = uniform(1, 60);
    int const seg_tiles = uniform(1, 9), n_blocks = uniform(1, 7);
    std::vector<int> start{0};
    while (start.back() < segments) start.push_back(std::min(segments, start.back() + uniform(1, 8)));
    int const raster = uniform(1, 10), grid = uniform(1, 140);
    std::vector<int> owners(segments);
    for (int i = 0; i < segments; ++i) owners[i] = i;
    std::shuffle(owners.begin(), owners.end(), rng);
    int const capacity = seg_tiles * kBlockM;
    // Full segments (nullptr), then counts from empty to over-full, some negative.
    check(owners, start, {}, seg_tiles, n_blocks, raster, grid);
    std::vector<int32_t> received(segments);
    for (int32_t& r : received) {
      int const kind = uniform(0, 9);
      r = kind == 0 ? 0 : kind == 1 ? capacity : kind == 2 ? capacity + uniform(1, 300) : kind == 3 ? -uniform(1, 5)
                                                                                       : uniform(1, capacity);
    }
    check(owners, start, received, seg_tiles, n_blocks, raster, grid);
    for (int32_t& r : received) r = uniform(1, capacity);
    check(owners, start, received, seg_tiles, n_blocks, raster, grid);
    cases += 3;
  }
  // The schedules' groups: every segment of every (e_local, world, rank, step, side) exactly once, the
  // local segments alone and on the side asked, the peers in step order from the rank.
  for (int world = 1; world <= 8; ++world) {
    for (int e_local = 1; e_local <= 5; ++e_local) {
      for (int rank = 0; rank < world; ++rank) {
        for (int step : {-1, 1}) {
          for (bool local_first : {false, true}) {
            entwine::ExpertGroups const g(e_local, world, rank, step, local_first);
            std::vector<int> seen(e_local * world, 0);
            for (int i = 0; i < g.count; ++i) {
              bool const local = g.size(i) == 1 && g.owner(i, 0) % world == rank;
              if (world > 1 && local != ((i < e_local) == local_first)) {
                fail("local groups on the wrong side", 0, 0, 0, i);
              }
              for (int j = 0; j < g.size(i); ++j) {
                int const o = g.owner(i, j);
                ++seen[o];
                if (!local && o % world != ((rank + step * (j + 1)) % world + world) % world) {
                  fail("peers out of step order", 0, 0, 0, o);
                }
              }
            }
            for (int v : seen) {
              if (v != 1) fail("an expert group's segment missing or repeated", e_local, world, rank, step);
            }
            ++cases;
          }
        }
      }
    }
  }
  if (failures) {
    std::printf("%d violations\n", failures);
    return 1;
  }
  std::printf("ok %d cases\n", cases);
  return 0;
}
