// moe_dispatch_gemm (static capacity) on W virtual ranks of one GPU: `moe test` runs every rank's
// transfers (copy engines or the SM push) and expert GEMM (16-bit, or FP8 per tensor) as a handler
// would, over several epochs (flags never reset), checks y against float64 on the host, and checks
// that a rank that never takes part ends its peers' waits with the deadline error naming it (plain
// launches and a CUDA graph); likewise moe_gemm_combine's GEMM (CombineWorld). `moe bench` times
// each fused call against the same kernels one after the other.
#include <cstring>

#include "harness/harness.h"
#include "moe/moe.h"

namespace entwine::harness {

struct MoeCase {
  int world, experts, capacity, k, n;
  MoeConfig config;
  bool bf16 = true;  // the output's type (and the 16-bit operands'): bf16, else fp16
  // FP8 per tensor: x_send in e4m3 (1) or e5m2 (2, a gradient), w_t [E_local, n, k] in e4m3, each
  // rank's scales fp8_scales(rank); 0: 16-bit operands.
  int fp8 = 0;
  // The rows each source sends each expert (MoeGemmArgs::received): 0, all C (no counts); > 0, that
  // many for every segment; kMixedRows, a mix of empty, partial and full segments (mixed_rows).
  int rows = 0;
  DType dtype() const { return bf16 ? DType::kBF16 : DType::kFP16; }
  DType input() const { return fp8 == 0 ? dtype() : fp8 == 1 ? DType::kE4M3 : DType::kE5M2; }
  int in_bytes() const { return element_bytes(input()); }
  MoeProblem problem(int rank) const { return MoeProblem{world, rank, experts, capacity, k, n, input()}; }
  int e_local() const { return experts / world; }
  int64_t send_elems() const { return int64_t(experts) * capacity * k; }
  int64_t w_elems() const { return int64_t(e_local()) * k * n; }
  int64_t y_rows() const { return int64_t(e_local()) * world * capacity; }
};

constexpr int kMixedRows = -1;

// Segment (expert e, source s) of rank r's mixed rows: empty, one row, a tile less or more one row,
// half, all; different for every segment, rank and seed.
int mixed_rows(int capacity, int r, int e, int s, uint64_t seed) {
  int const choices[] = {0, 1, 127, 128, 129, capacity / 2 + 3, capacity - 1, capacity};
  return std::min(capacity, choices[(seed * 7 + r * 5 + e * 3 + s) % 8]);
}

std::string describe(MoeCase const& c) {
  char buf[224];
  char rows[32] = "";
  if (c.rows == kMixedRows) std::snprintf(rows, sizeof rows, " rows=mixed");
  if (c.rows > 0) std::snprintf(rows, sizeof rows, " rows=%d", c.rows);
  std::snprintf(buf, sizeof buf, "moe W=%d E=%d C=%d K=%d N=%d %s%s block_n=%d gemm_sms=%d r=%d push_sms=%d%s", c.world,
                c.experts, c.capacity, c.k, c.n, c.fp8 == 0 ? "" : c.fp8 == 1 ? "e4m3->" : "e5m2->",
                c.bf16 ? "bf16" : "fp16", int(c.config.block_n),
                int(c.config.gemm_sms), int(c.config.raster_rows), int(c.config.push_sms), rows);
  return buf;
}

std::vector<uint16_t> download_u16(void const* ptr, size_t count) {
  std::vector<uint16_t> h(count);
  CHECK_CUDA(cudaMemcpy(h.data(), ptr, count * 2, cudaMemcpyDeviceToHost));
  return h;
}

// An operand as doubles: 16-bit (fp8 == 0; bf16 or fp16), else FP8 bytes (e5m2 or e4m3) times `scale`.
std::vector<double> download_operand(void const* ptr, size_t count, int fp8, bool bf16, bool e5m2, double scale) {
  std::vector<double> v(count);
  if (fp8 == 0) {
    auto const bits = download_u16(ptr, count);
    for (size_t i = 0; i < count; ++i) v[i] = to_double(bits[i], bf16);
    return v;
  }
  std::vector<uint8_t> bits(count);
  CHECK_CUDA(cudaMemcpy(bits.data(), ptr, count, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < count; ++i) v[i] = fp8_to_double(bits[i], e5m2) * scale;
  return v;
}

// One rank's synchronisation words, zeroed: flags (two parities of `flag_words`), ready words
// (kMaxWorld) and the arrival counters (the op's workspace).
void alloc_sync_words(int64_t flag_words, uint64_t** flags, uint64_t** ready, uint32_t** arrivals) {
  CHECK_CUDA(cudaMalloc(flags, 2 * flag_words * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemset(*flags, 0, 2 * flag_words * sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(ready, kMaxWorld * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemset(*ready, 0, kMaxWorld * sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(arrivals, kMoePushArrivalsBytes));
  CHECK_CUDA(cudaMemset(*arrivals, 0, kMoePushArrivalsBytes));
}

// After a call's work was enqueued: wait for it, then advance the epoch.
void finish_call(uint64_t* epoch_word) {
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(comm::launch_end_call(comm::CallEnd{epoch_word}, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
}

DeviceError read_device_error(DeviceError const* error) {
  DeviceError e;
  CHECK_CUDA(cudaMemcpy(&e, error, sizeof e, cudaMemcpyDeviceToHost));
  return e;
}

// W ranks' GEMMs share this GPU: each gets a grid that leaves SMs for the others and for the
// release kernels or its SM push (on a real node each GPU runs one GEMM on all SMs the push leaves).
MoeConfig moe_config_for(int world, int block_n, int raster_rows = 8, int push_sms = 0) {
  return MoeConfig{block_n, std::max(1, sm_count() / world - 2 - push_sms), raster_rows, push_sms};
}

// Every rank's x_send, w, y, inbox, flags (two parities) and ready words in this GPU's memory. Rank
// r's transfer to rank r + d runs on its transfer stream d (the staggered order: every receiver's
// first segments come from rank - 1), its GEMM on its own stream; with config.push_sms, its SM push
// runs on the GEMM's stream ahead of the GEMM, which is launched as its programmatic dependent.
struct MoeWorld {
  struct Rank {
    void *x_send = nullptr, *w = nullptr;  // x_send's and w's type: MoeCase::input()
    uint16_t* y = nullptr;
    float* x_scales = nullptr;  // FP8: every source's x scale [world]; then w's
    int32_t* received = nullptr;  // [E_local, world] with MoeCase::rows, else nullptr
    std::vector<int32_t> received_host;
    int32_t* sent = nullptr;  // [experts] with MoeCase::rows (the peers' received), else nullptr
    char* inbox = nullptr;
    uint64_t* flags = nullptr;  // two parities of plan.flags words
    uint64_t* ready = nullptr;  // kMaxWorld words: ready[s] = the last call rank s announced
    uint32_t* arrivals = nullptr;  // the SM push's counters (the op's workspace)
    cudaStream_t gemm = nullptr;
    cudaStream_t transfer[kMaxWorld] = {};
  };
  MoeCase c;
  MoePlan plan;               // rank 0's: the sizes every rank shares
  std::vector<MoePlan> plans;  // each rank's
  std::vector<Rank> ranks;
  DeviceError* error = nullptr;
  uint64_t epoch = 0;              // the last call's epoch, as the host counts it
  uint64_t* epoch_word = nullptr;  // the next call's epoch, on the device (one word for all ranks)
  uint64_t timeout_ns = 3'000'000'000ull;
  // What enqueue launches: the whole call (transfers and the GEMMs that wait on them), the
  // transfers alone with the receivers' wait kernel (moe_transfer), or the GEMMs alone.
  enum class Part { kCall, kTransfers, kGemms };
  Part part = Part::kCall;

  explicit MoeWorld(MoeCase const& c_) : c(c_), plan(moe_plan(c_.problem(0), c_.config)), ranks(c_.world) {
    for (int r = 0; r < c.world; ++r) plans.push_back(moe_plan(c.problem(r), c.config));
    int lo, hi;
    CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    for (auto& r : ranks) {
      CHECK_CUDA(cudaMalloc(&r.x_send, size_t(c.send_elems()) * c.in_bytes()));
      CHECK_CUDA(cudaMalloc(&r.w, size_t(c.w_elems()) * c.in_bytes()));
      CHECK_CUDA(cudaMalloc(&r.x_scales, (c.world + 1) * sizeof(float)));
      if (c.rows != 0) CHECK_CUDA(cudaMalloc(&r.received, size_t(c.experts) * sizeof(int32_t)));
      if (c.rows != 0) CHECK_CUDA(cudaMalloc(&r.sent, size_t(c.experts) * sizeof(int32_t)));
      CHECK_CUDA(cudaMalloc(&r.y, size_t(c.y_rows()) * c.n * 2));
      CHECK_CUDA(cudaMalloc(&r.inbox, plan.inbox_bytes));
      // Stale rows a wrong wait would read show as NaN in y.
      CHECK_CUDA(cudaMemset(r.inbox, 0xFF, plan.inbox_bytes));
      alloc_sync_words(plan.flags, &r.flags, &r.ready, &r.arrivals);
      CHECK_CUDA(cudaStreamCreateWithPriority(&r.gemm, cudaStreamNonBlocking, lo));
      for (int d = 1; d < c.world; ++d) CHECK_CUDA(cudaStreamCreateWithPriority(&r.transfer[d], cudaStreamNonBlocking, hi));
    }
    CHECK_CUDA(cudaMalloc(&error, sizeof(DeviceError)));
    CHECK_CUDA(cudaMemset(error, 0, sizeof(DeviceError)));
    CHECK_CUDA(cudaMalloc(&epoch_word, sizeof(uint64_t)));
    set_epoch(1);
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  ~MoeWorld() {
    for (auto& r : ranks) {
      cudaFree(r.x_send);
      cudaFree(r.w);
      cudaFree(r.x_scales);
      cudaFree(r.received);
      cudaFree(r.sent);
      cudaFree(r.y);
      cudaFree(r.inbox);
      cudaFree(r.flags);
      cudaFree(r.ready);
      cudaFree(r.arrivals);
      cudaStreamDestroy(r.gemm);
      for (int d = 1; d < c.world; ++d) cudaStreamDestroy(r.transfer[d]);
    }
    cudaFree(error);
    cudaFree(epoch_word);
  }

  void set_epoch(uint64_t next) {
    CHECK_CUDA(cudaMemcpy(epoch_word, &next, sizeof(next), cudaMemcpyHostToDevice));
    epoch = next - 1;
  }

  // Rank r's call: its announcements go to every peer's ready word for r (whichever of its kernels
  // starts first announces).
  CallEpoch call_epoch(int r) const {
    CallEpoch call{epoch_word, 0, plan.flags, false};
    for (int q = 0; q < c.world; ++q) call.announce[q] = q == r ? nullptr : ranks[q].ready + r;
    return call;
  }

  void fill_inputs(uint64_t seed) {
    std::vector<float> scales(c.world + 1);
    for (int q = 0; q < c.world; ++q) scales[q] = fp8_scales(q)[0];
    for (int r = 0; r < c.world; ++r) {
      if (c.fp8 == 0) {
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(ranks[r].x_send), c.send_elems(), seed * 131 + 2 * r, c.bf16);
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(ranks[r].w), c.w_elems(), seed * 131 + 2 * r + 1, c.bf16);
      } else {
        fill_random_fp8<<<264, 256>>>(static_cast<uint8_t*>(ranks[r].x_send), c.send_elems(), seed * 131 + 2 * r,
                                      c.fp8 == 2);
        fill_random_fp8<<<264, 256>>>(static_cast<uint8_t*>(ranks[r].w), c.w_elems(), seed * 131 + 2 * r + 1);
      }
      scales[c.world] = fp8_scales(r)[1];
      CHECK_CUDA(cudaMemcpy(ranks[r].x_scales, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice));
      if (c.rows == 0) continue;
      // x_send stays random past the rows sent: only a skipped block gives zeros there.
      auto& rows = ranks[r].received_host;
      rows.assign(c.experts, 0);
      for (int e = 0; e < c.e_local(); ++e) {
        for (int q = 0; q < c.world; ++q) {
          rows[e * c.world + q] = c.rows > 0 ? std::min(c.rows, c.capacity) : mixed_rows(c.capacity, r, e, q, seed);
        }
      }
      CHECK_CUDA(cudaMemcpy(ranks[r].received, rows.data(), rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
    // What each source sends each destination's expert: the destination's received rows.
    for (int q = 0; c.rows != 0 && q < c.world; ++q) {
      std::vector<int32_t> sent(c.experts);
      for (int r = 0; r < c.world; ++r)
        for (int e = 0; e < c.e_local(); ++e) sent[r * c.e_local() + e] = ranks[r].received_host[e * c.world + q];
      CHECK_CUDA(cudaMemcpy(ranks[q].sent, sent.data(), sent.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  void poison_outputs() {
    for (auto& r : ranks) CHECK_CUDA(cudaMemset(r.y, 0xFF, size_t(c.y_rows()) * c.n * 2));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // Rank r's SM push to every peer, on its GEMM's stream.
  void enqueue_sm_push(int r) {
    MoePushArgs a{};
    a.x_send = ranks[r].x_send;
    for (int q = 0; q < c.world; ++q) {
      a.inbox[q] = ranks[q].inbox;
      a.flags[q] = ranks[q].flags;
    }
    a.ready = ranks[r].ready;
    a.arrivals = ranks[r].arrivals;
    a.slice_bytes = plan.slice_bytes;
    a.row_bytes = plan.slice_bytes / c.capacity;
    a.sent = ranks[r].sent;
    a.e_local = plan.e_local;
    a.rank = r;
    a.world = c.world;
    a.error = error;
    a.call = call_epoch(r);
    a.timeout_ns = timeout_ns;
    CHECK_CUDA(moe::launch_push(plans[r], a, ranks[r].gemm));
  }

  // Every rank's GEMM (after its SM push, if the plan has one), then its copy-engine transfers to
  // rank + 1, rank + 2, ... each on its own stream; skip_rank neither pushes nor runs its GEMM.
  void enqueue(int skip_rank) {
    bool const sm_push = plan.push_grid > 0 && part != Part::kGemms;
    for (int r = 0; r < c.world; ++r) {
      if (r == skip_rank) continue;
      MoeGemmArgs const a{ranks[r].x_send, ranks[r].inbox, ranks[r].w, ranks[r].y, ranks[r].flags, error, nullptr,
                          call_epoch(r), timeout_ns, ranks[r].x_scales, ranks[r].x_scales + c.world,
                          ranks[r].received};
      if (sm_push) enqueue_sm_push(r);
      if (part == Part::kTransfers) {
        MoeWaitArgs const wa{ranks[r].flags, plan.e_local, r, c.world, error, nullptr, call_epoch(r), timeout_ns};
        CHECK_CUDA(moe::launch_wait_segments(wa, ranks[r].gemm));
        continue;
      }
      PreparedGemm gemm;
      CHECK_CUDA(moe::prepare_gemm(c.input(), c.dtype(), plans[r], a, &gemm));
      CHECK_CUDA(gemm.enqueue(ranks[r].gemm, sm_push));
    }
    for (int r = 0; r < c.world && plan.push_grid == 0 && part != Part::kGemms; ++r) {
      if (r == skip_rank) continue;
      for (int d = 1; d < c.world; ++d) {
        int const q = (r + d) % c.world;
        MoeTransferArgs const t{ranks[r].x_send, ranks[q].inbox, ranks[q].flags, ranks[r].ready + q, r, q, error,
                                nullptr, call_epoch(r), timeout_ns};
        CHECK_CUDA(moe::launch_push_copy(plans[r], t, ranks[r].transfer[d]));
      }
    }
  }

  // One call on every rank, then the epoch advance.
  void call(int skip_rank = -1) {
    ++epoch;
    enqueue(skip_rank);
    finish_call(epoch_word);
  }

  std::vector<cudaStream_t> streams() const {
    std::vector<cudaStream_t> all;
    for (auto& r : ranks) {
      all.push_back(r.gemm);
      for (int d = 1; d < c.world; ++d) all.push_back(r.transfer[d]);
    }
    return all;
  }

  cudaGraphExec_t capture(cudaStream_t origin, int skip_rank = -1) {
    return capture_call(origin, streams(), epoch_word, [&] { enqueue(skip_rank); });
  }

  // Relative error of every rank's y against float64, over every (expert, source) segment's rows i
  // with i % 16 == (e + q) % 16 (every tile row of every segment, 8 or more rows each):
  // y[e, q * C + i, :] = x_send_q[r * E_local + e, i, :] @ w_r[e] (FP8: each operand times its rank's
  // scale, w_r[e] = w_t_r[e]^T); with MoeCase::rows, exactly zero in the tiles wholly past the rows
  // sent (inf otherwise).
  double check() {
    std::vector<std::vector<double>> xs;
    for (int q = 0; q < c.world; ++q) {
      xs.push_back(download_operand(ranks[q].x_send, size_t(c.send_elems()), c.fp8, c.bf16, c.fp8 == 2, fp8_scales(q)[0]));
    }
    int const el = c.e_local(), cap = c.capacity, k = c.k, n = c.n;
    double err2 = 0, ref2 = 0;
    std::vector<double> ref(n);
    for (int r = 0; r < c.world; ++r) {
      std::vector<double> w = download_operand(ranks[r].w, size_t(c.w_elems()), c.fp8, c.bf16, false, fp8_scales(r)[1]);
      if (c.fp8 != 0) {  // w_t [E_local, n, k] -> w [E_local, k, n]
        std::vector<double> const w_t = w;
        for (int e = 0; e < c.e_local(); ++e)
          for (int j = 0; j < c.n; ++j)
            for (int kk = 0; kk < c.k; ++kk) w[(size_t(e) * c.k + kk) * c.n + j] = w_t[(size_t(e) * c.n + j) * c.k + kk];
      }
      auto const y = download_u16(ranks[r].y, size_t(c.y_rows()) * n);
      for (int e = 0; e < el; ++e) {
        double const* we = w.data() + size_t(e) * k * n;
        for (int q = 0; q < c.world; ++q) {
          for (int i = (e + q) % 16; i < cap; i += 16) {
            uint16_t const* yrow = y.data() + (size_t(e) * c.world * cap + size_t(q) * cap + i) * n;
            if (c.rows != 0 && i / 128 * 128 >= ranks[r].received_host[e * c.world + q]) {
              if (std::any_of(yrow, yrow + n, [](uint16_t v) { return v != 0; })) return INFINITY;
              continue;
            }
            double const* xrow = xs[q].data() + (size_t(r * el + e) * cap + i) * k;
            std::fill(ref.begin(), ref.end(), 0.0);
            for (int kk = 0; kk < k; ++kk) {
              double const xv = xrow[kk];
              double const* wr = we + size_t(kk) * n;
              for (int j = 0; j < n; ++j) ref[j] += xv * wr[j];
            }
            for (int j = 0; j < n; ++j) {
              double const o = to_double(yrow[j], c.bf16);
              if (std::isnan(o)) return INFINITY;
              err2 += (o - ref[j]) * (o - ref[j]);
              ref2 += ref[j] * ref[j];
            }
          }
        }
      }
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  }

  std::vector<std::vector<uint16_t>> outputs() {
    std::vector<std::vector<uint16_t>> o;
    for (auto& r : ranks) o.push_back(download_u16(r.y, size_t(c.y_rows()) * c.n));
    return o;
  }

  // After a call: every rank's receive pool (launch_copy_pool, as the handler copies it out) holds
  // source q's rows of segment (e, q) byte for byte up to its received rows rounded up to whole
  // 128-row blocks, zeros past them; the pool starts poisoned. Returns the number of wrong segments.
  int check_pool() {
    int64_t const row_bytes = plan.slice_bytes / c.capacity;
    int64_t const pool_bytes = int64_t(c.e_local()) * c.world * plan.slice_bytes;
    std::vector<std::vector<char>> send(c.world, std::vector<char>(size_t(c.experts) * plan.slice_bytes));
    for (int q = 0; q < c.world; ++q)
      CHECK_CUDA(cudaMemcpy(send[q].data(), ranks[q].x_send, send[q].size(), cudaMemcpyDeviceToHost));
    char* pool = nullptr;
    CHECK_CUDA(cudaMalloc(&pool, pool_bytes));
    std::vector<char> got(pool_bytes);
    int wrong = 0;
    for (int r = 0; r < c.world; ++r) {
      CHECK_CUDA(cudaMemset(pool, 0xFF, pool_bytes));
      MoePoolArgs a{static_cast<const char*>(ranks[r].x_send) + int64_t(r) * c.e_local() * plan.slice_bytes,
                    ranks[r].inbox, pool, ranks[r].received, plan.slice_bytes, row_bytes, c.e_local(), r, c.world};
      CHECK_CUDA(moe::launch_copy_pool(a, nullptr));
      CHECK_CUDA(cudaMemcpy(got.data(), pool, got.size(), cudaMemcpyDeviceToHost));
      for (int e = 0; e < c.e_local(); ++e) {
        for (int q = 0; q < c.world; ++q) {
          int const i = e * c.world + q;
          int64_t const moved = segment_rows(c.rows != 0 ? ranks[r].received_host.data() : nullptr, i, c.capacity) *
                                row_bytes;
          char const* seg = got.data() + i * plan.slice_bytes;
          char const* want = send[q].data() + (int64_t(r) * c.e_local() + e) * plan.slice_bytes;
          bool ok = std::memcmp(seg, want, moved) == 0;
          ok = ok && std::all_of(seg + moved, seg + plan.slice_bytes, [](char b) { return b == 0; });
          wrong += !ok;
        }
      }
    }
    cudaFree(pool);
    return wrong;
  }

  DeviceError read_error() const { return read_device_error(error); }
};

void run_moe_case(MoeCase const& c, int epochs) {
  MoePlan const plan = moe_plan(c.problem(0), c.config);
  if (plan.error) {
    expect(false, describe(c) + ": " + plan.error);
    return;
  }
  MoeWorld world(c);
  double worst = 0;
  for (int e = 0; e < epochs; ++e) {
    world.fill_inputs(4000 + e);
    world.poison_outputs();
    world.call();
    worst = std::max(worst, world.check());
  }
  auto first = world.outputs();
  world.poison_outputs();
  world.call();
  bool const bitwise = world.outputs() == first;
  int const pool_wrong = world.check_pool();
  DeviceError const e = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[192];
  std::snprintf(buf, sizeof buf,
                ": %d blocks, %d epochs, rel err %.2e (tol %.0e), bitwise repeat %s, pool segments wrong %d, error %u",
                plan.num_blocks, epochs, worst, tol, bitwise ? "yes" : "NO", pool_wrong, e.code);
  expect(worst <= tol && bitwise && pool_wrong == 0 && e.code == 0, describe(c) + buf);
}

// moe_transfer's moves alone (no GEMM): after each call every rank's inbox holds, at segment
// (e, q), source q's rows for its expert e, byte for byte; a missing rank ends the waits with the
// deadline naming it.
void run_moe_transfer(int world_size, int experts, int push_sms) {
  MoeCase c{world_size, experts, 128, 256, 256, moe_config_for(world_size, 128, 8, push_sms)};
  MoeWorld world(c);
  world.part = MoeWorld::Part::kTransfers;
  bool same = true;
  for (int epoch = 0; epoch < 3; ++epoch) {
    world.fill_inputs(700 + epoch);
    for (auto& r : world.ranks) CHECK_CUDA(cudaMemset(r.inbox, 0xFF, world.plan.inbox_bytes));
    world.call();
    for (int r = 0; r < world_size; ++r) {
      std::vector<char> inbox(world.plan.inbox_bytes);
      CHECK_CUDA(cudaMemcpy(inbox.data(), world.ranks[r].inbox, inbox.size(), cudaMemcpyDeviceToHost));
      for (int q = 0; q < world_size; ++q) {
        if (q == r) continue;
        std::vector<char> sent(world.plan.slice_bytes);
        for (int e = 0; e < world.plan.e_local; ++e) {
          CHECK_CUDA(cudaMemcpy(sent.data(), reinterpret_cast<char*>(world.ranks[q].x_send) +
                                                  (int64_t(r) * world.plan.e_local + e) * world.plan.slice_bytes,
                                sent.size(), cudaMemcpyDeviceToHost));
          same = same && std::memcmp(sent.data(), inbox.data() + (int64_t(e) * world_size + q) * world.plan.slice_bytes,
                                     sent.size()) == 0;
        }
      }
    }
  }
  DeviceError const ok = world.read_error();
  world.timeout_ns = 200'000'000ull;
  world.call(world_size - 1);
  DeviceError const e = world.read_error();
  char buf[224];
  std::snprintf(buf, sizeof buf, "moe transfer W=%d E=%d push_sms=%d: 3 epochs %s, error %u; missing rank: code=%u site=%d source=%d",
                world_size, experts, push_sms, same ? "byte-exact" : "DIFFER", ok.code, e.code, e.site, e.source);
  bool const site_ok = e.site == kMoeWaitTransfer || e.site == kMoeWaitInboxReady;
  expect(same && ok.code == 0 && e.code == kErrorDeadline && site_ok && e.source == world_size - 1, buf);
}

// moe_gemm_combine on W virtual ranks of one GPU: every rank's h [E_local, W*C, F] and w2
// [E_local, F, H] (FP8: h in e4m3 (1) or e5m2 (2, a gradient's), w2_t [E_local, H, F] in e4m3, the
// rank's fp8_scales), inbox (o_recv [E, C, H] as the GEMMs store it), o_recv (the inbox copied out
// after the wait), flags (two parities), ready words and arrival counters; one stream per rank.
struct CombineWorld {
  struct Rank {
    void *h = nullptr, *w = nullptr;
    float* scales = nullptr;  // FP8: h's and w2's
    char* inbox = nullptr;
    char* o_recv = nullptr;
    uint64_t *flags = nullptr, *ready = nullptr;
    uint32_t* arrivals = nullptr;
    int32_t* received = nullptr;  // [E_local, world] with `rows`, else nullptr
    std::vector<int32_t> received_host;
    cudaStream_t stream = nullptr;
  };
  int world, experts, capacity, f, n;  // n: H
  bool bf16;
  int fp8;
  DType out_type, input;
  MoePlan plan;                // rank 0's: the sizes every rank shares (plan.error: nothing allocated)
  std::vector<MoePlan> plans;  // each rank's
  std::vector<Rank> ranks;
  // What enqueue launches: the op as the handler runs it (each GEMM stores into the sources'
  // inboxes and releases the segments, then each rank's wait and copy out), or the same GEMMs
  // storing into `stage` alone, or followed by each rank's copies of its rows into every o_recv.
  enum class Part { kCall, kLocalGemms, kLocalGemmsThenMove };
  Part part = Part::kCall;
  // The rows of h's segments their sources read back (MoeCombineArgs::received), as MoeCase::rows.
  int rows_sent = 0;
  // stage + q * inbox_bytes: destination q's rows [E, C, H], whose block of rank r's experts only
  // rank r writes (its send buffer); allocated by allocate_stage().
  char* stage = nullptr;
  DeviceError* error = nullptr;
  uint64_t* epoch_word = nullptr;  // the next call's epoch (one word for all ranks)
  uint64_t timeout_ns = 3'000'000'000ull;

  CombineWorld(CombineWorld const&) = delete;
  CombineWorld& operator=(CombineWorld const&) = delete;
  CombineWorld(int world_, int experts_, int capacity_, int f_, int n_, int block_n, bool bf16_, int fp8_)
      : world(world_), experts(experts_), capacity(capacity_), f(f_), n(n_), bf16(bf16_), fp8(fp8_),
        out_type(bf16_ ? DType::kBF16 : DType::kFP16),
        input(fp8_ == 0 ? out_type : fp8_ == 1 ? DType::kE4M3 : DType::kE5M2) {
    MoeConfig const cfg = moe_config_for(world, block_n);
    for (int r = 0; r < world; ++r) plans.push_back(moe_combine_plan(MoeProblem{world, r, experts, capacity, f, n, input}, cfg));
    plan = plans[0];
    if (plan.error) return;
    ranks.resize(world);
    for (auto& r : ranks) {
      CHECK_CUDA(cudaMalloc(&r.h, size_t(h_elems()) * element_bytes(input)));
      CHECK_CUDA(cudaMalloc(&r.w, size_t(w_elems()) * element_bytes(input)));
      CHECK_CUDA(cudaMalloc(&r.scales, 2 * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&r.inbox, plan.inbox_bytes));
      CHECK_CUDA(cudaMalloc(&r.o_recv, plan.inbox_bytes));
      alloc_sync_words(plan.flags, &r.flags, &r.ready, &r.arrivals);
      CHECK_CUDA(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    }
    CHECK_CUDA(cudaMalloc(&error, sizeof(DeviceError)));
    CHECK_CUDA(cudaMemset(error, 0, sizeof(DeviceError)));
    CHECK_CUDA(cudaMalloc(&epoch_word, sizeof(uint64_t)));
    uint64_t const first = 1;
    CHECK_CUDA(cudaMemcpy(epoch_word, &first, sizeof first, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  ~CombineWorld() {
    for (auto& r : ranks) {
      cudaFree(r.h);
      cudaFree(r.w);
      cudaFree(r.scales);
      cudaFree(r.inbox);
      cudaFree(r.o_recv);
      cudaFree(r.flags);
      cudaFree(r.ready);
      cudaFree(r.arrivals);
      cudaFree(r.received);
      cudaStreamDestroy(r.stream);
    }
    cudaFree(stage);
    cudaFree(error);
    cudaFree(epoch_word);
  }

  int64_t h_elems() const { return int64_t(plan.e_local) * world * capacity * f; }
  int64_t w_elems() const { return int64_t(plan.e_local) * f * n; }

  std::string name() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "moe combine W=%d E=%d C=%d F=%d H=%d %s%s block_n=%d", world, experts, capacity,
                  f, n, fp8 == 0 ? "" : fp8 == 1 ? "e4m3->" : "e5m2->", bf16 ? "bf16" : "fp16",
                  int(plan.config.block_n));
    return buf;
  }

  void allocate_stage() {
    if (!stage) CHECK_CUDA(cudaMalloc(&stage, size_t(world) * plan.inbox_bytes));
  }

  // Rank r's call; its GEMM stores into every rank's inbox, or with `local` into `stage`. The local
  // calls still release the peers' flags: the fused call's waits stay honest only because every
  // replay runs at a new epoch (never reset the epoch or set flags ahead between replays).
  MoeCombineArgs args(int r, bool local) const {
    MoeCombineArgs a{};
    a.h = ranks[r].h;
    a.w = ranks[r].w;
    a.x_scale = ranks[r].scales;
    a.w_scale = ranks[r].scales + 1;
    a.received = ranks[r].received;
    for (int q = 0; q < world; ++q) {
      a.inbox[q] = local ? stage + q * plan.inbox_bytes : ranks[q].inbox;
      a.flags[q] = ranks[q].flags;
    }
    a.ready = ranks[r].ready;
    a.arrivals = ranks[r].arrivals;
    a.error = error;
    a.call = CallEpoch{epoch_word, 0, plan.flags, false};
    for (int q = 0; q < world; ++q) a.call.announce[q] = q == r ? nullptr : ranks[q].ready + r;
    a.timeout_ns = timeout_ns;
    return a;
  }

  // Every rank's part on its stream, but skip_rank's (a rank that never comes).
  void enqueue(int skip_rank = -1) {
    bool const local = part != Part::kCall;
    if (local && !stage) {
      std::fprintf(stderr, "CombineWorld: the local parts need allocate_stage()\n");
      std::exit(2);
    }
    for (int r = 0; r < world; ++r) {
      if (r == skip_rank) continue;
      MoeCombineArgs const a = args(r, local);
      PreparedGemm gemm;
      CHECK_CUDA(moe::combine::prepare_gemm(input, out_type, plans[r], a, &gemm));
      CHECK_CUDA(gemm.enqueue(ranks[r].stream));
      if (part == Part::kCall) {
        MoeWaitArgs const wa{ranks[r].flags, plan.e_local, r, world, error, nullptr, a.call, timeout_ns};
        CHECK_CUDA(moe::launch_wait_segments(wa, ranks[r].stream));
        CHECK_CUDA(cudaMemcpyAsync(ranks[r].o_recv, ranks[r].inbox, plan.inbox_bytes, cudaMemcpyDeviceToDevice,
                                   ranks[r].stream));
      } else if (part == Part::kLocalGemmsThenMove) {
        // Rank r's rows of every destination, one copy each, to rank + 1 first (its own last).
        int64_t const block = plan.inbox_bytes / world, at = r * block;
        for (int d = 1; d <= world; ++d) {
          int const q = (r + d) % world;
          CHECK_CUDA(cudaMemcpyAsync(ranks[q].o_recv + at, stage + q * plan.inbox_bytes + at, block,
                                     cudaMemcpyDeviceToDevice, ranks[r].stream));
        }
      }
    }
  }

  // One call of every rank (but skip_rank), then the epoch advance.
  void call(int skip_rank = -1) {
    enqueue(skip_rank);
    finish_call(epoch_word);
  }

  std::vector<cudaStream_t> streams() const {
    std::vector<cudaStream_t> all;
    for (auto& r : ranks) all.push_back(r.stream);
    return all;
  }

  // enqueue's part of every rank as one graph; its last node advances the epoch.
  cudaGraphExec_t capture(cudaStream_t origin) {
    return capture_call(origin, streams(), epoch_word, [&] { enqueue(); });
  }

  void fill_inputs(uint64_t seed) {
    for (int r = 0; r < world; ++r) {
      uint64_t const s = seed + 2 * r;
      if (fp8 == 0) {
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(ranks[r].h), h_elems(), s, bf16);
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(ranks[r].w), w_elems(), s + 1, bf16);
      } else {
        fill_random_fp8<<<264, 256>>>(static_cast<uint8_t*>(ranks[r].h), h_elems(), s, fp8 == 2);
        fill_random_fp8<<<264, 256>>>(static_cast<uint8_t*>(ranks[r].w), w_elems(), s + 1);
      }
      std::array<float, 2> const scales = fp8_scales(r);
      CHECK_CUDA(cudaMemcpy(ranks[r].scales, scales.data(), sizeof scales, cudaMemcpyHostToDevice));
      if (rows_sent == 0) continue;
      auto& got = ranks[r].received_host;
      got.assign(experts, 0);
      for (int e = 0; e < plan.e_local; ++e) {
        for (int q = 0; q < world; ++q) {
          got[e * world + q] = rows_sent > 0 ? std::min(rows_sent, capacity) : mixed_rows(capacity, r, e, q, seed);
        }
      }
      if (!ranks[r].received) CHECK_CUDA(cudaMalloc(&ranks[r].received, got.size() * sizeof(int32_t)));
      CHECK_CUDA(cudaMemcpy(ranks[r].received, got.data(), got.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // Stale rows show as NaN.
  void poison() {
    for (auto& r : ranks) {
      CHECK_CUDA(cudaMemset(r.inbox, 0xFF, plan.inbox_bytes));
      CHECK_CUDA(cudaMemset(r.o_recv, 0xFF, plan.inbox_bytes));
    }
    if (stage) CHECK_CUDA(cudaMemset(stage, 0xFF, size_t(world) * plan.inbox_bytes));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // Every rank's o_recv against float64, over rows i % 16 == (e + q) % 16 of every segment:
  // o_recv_q[r*E_local + e, i] = h_r[e, q*C + i] @ w2_r[e]. The relative error (inf: a NaN row). With
  // rows_sent, the tiles wholly past a segment's rows are never sent: they must still hold the poison.
  double check() {
    int const el = plan.e_local, rows = world * capacity;
    double err2 = 0, ref2 = 0;
    for (int r = 0; r < world; ++r) {
      auto const hh = download_operand(ranks[r].h, size_t(h_elems()), fp8, bf16, fp8 == 2, fp8_scales(r)[0]);
      auto const ww = download_operand(ranks[r].w, size_t(w_elems()), fp8, bf16, false, fp8_scales(r)[1]);
      for (int q = 0; q < world; ++q) {
        auto const got = download_u16(ranks[q].o_recv, plan.inbox_bytes / 2);
        for (int e = 0; e < el; ++e) {
          for (int i = (e + q) % 16; i < capacity; i += 16) {
            uint16_t const* out = got.data() + (size_t(r * el + e) * capacity + i) * n;
            if (rows_sent != 0 && i / 128 * 128 >= ranks[r].received_host[e * world + q]) {
              if (std::any_of(out, out + n, [](uint16_t v) { return v != 0xFFFF; })) return INFINITY;
              continue;
            }
            for (int j = 0; j < n; ++j) {
              double ref = 0;
              for (int kk = 0; kk < f; ++kk) {
                // w2 [E_local, F, H], or FP8 w2_t [E_local, H, F].
                size_t const wi = fp8 == 0 ? (size_t(e) * f + kk) * n + j : (size_t(e) * n + j) * f + kk;
                ref += hh[(size_t(e) * rows + q * capacity + i) * f + kk] * ww[wi];
              }
              double const o = to_double(out[j], bf16);
              err2 += std::isnan(o) ? INFINITY : (o - ref) * (o - ref);
              ref2 += ref * ref;
            }
          }
        }
      }
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  }

  std::vector<std::vector<uint16_t>> outputs() {
    std::vector<std::vector<uint16_t>> o;
    for (auto& r : ranks) o.push_back(download_u16(r.o_recv, plan.inbox_bytes / 2));
    return o;
  }

  DeviceError read_error() const { return read_device_error(error); }
};

// moe_gemm_combine's GEMM on W virtual ranks (CombineWorld, Part::kCall): each rank's GEMM stores
// block by block into every source's inbox, each segment released by a flag; each rank's wait kernel
// then acquires its peers' segments and the rank's stream copies its inbox out, as the handler does
// (a flag released before its rows landed shows). Over several epochs every copied row against
// float64, and a repeat bitwise; then a rank that never takes part: its peers' waits end with the
// deadline naming it.
void run_moe_combine(int world_size, int experts, int capacity, int f, int h, int block_n, bool bf16 = true,
                     int fp8 = 0, int rows_sent = 0) {
  CombineWorld world(world_size, experts, capacity, f, h, block_n, bf16, fp8);
  world.rows_sent = rows_sent;
  if (world.plan.error) {
    expect(false, world.name() + ": " + world.plan.error);
    return;
  }
  double worst = 0;
  bool repeat_same = true;
  for (int epoch = 0; epoch < 3; ++epoch) {
    world.fill_inputs(900 + 10 * epoch);
    world.poison();
    world.call();
    worst = std::max(worst, world.check());
    // The same inputs again (the inboxes poisoned): every rank's copied rows bitwise equal.
    auto const first_rows = world.outputs();
    world.poison();
    world.call();
    repeat_same = repeat_same && world.outputs() == first_rows;
  }
  DeviceError const healthy = world.read_error();
  world.timeout_ns = 200'000'000ull;
  int const missing = world_size - 1;
  world.call(missing);
  DeviceError const e = world.read_error();
  double const tol = bf16 ? 1e-2 : 2e-3;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s: 3 epochs, rel err %.2e (tol %.0e), repeats %s, error %u; missing rank: code=%u site=%d source=%d",
                rows_sent == kMixedRows ? " rows=mixed" : rows_sent > 0 ? " rows=fixed" : "", worst, tol, repeat_same ? "bitwise equal" : "DIFFER", healthy.code, e.code, e.site, e.source);
  bool const site_ok = world_size == 1 || e.site == kMoeWaitTransfer || e.site == kMoeWaitCombineReady;
  bool const missing_ok = world_size == 1 || (e.code == kErrorDeadline && site_ok && e.source == missing);
  expect(worst <= tol && repeat_same && healthy.code == 0 && missing_ok, world.name() + buf);
}

// A rank that never takes part: a peer's GEMM waiting on its segments, or a peer's transfer waiting
// for its announcement, must record the deadline naming it, within seconds.
void run_moe_deadline(int world_size, int experts, int push_sms = 0) {
  MoeCase c{world_size, experts, 128, 256, 256, moe_config_for(world_size, 128, 8, push_sms)};
  MoeWorld world(c);
  world.fill_inputs(9);
  world.call();
  int const missing = world_size - 1;
  world.timeout_ns = 200'000'000ull;
  auto t0 = std::chrono::steady_clock::now();
  world.call(missing);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DeviceError const e = world.read_error();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "moe deadline W=%d E=%d push_sms=%d: code=%u site=%d rank=%d source=%d expert=%d expected=%llu after %.2f s",
                world_size, experts, push_sms, e.code, e.site, e.rank, e.source, e.tile, (unsigned long long)e.expected, secs);
  bool const site_ok = e.site == kMoeWaitSegment || e.site == kMoeWaitInboxReady;
  expect(e.code == kErrorDeadline && site_ok && e.source == missing && stamp_epoch(e.expected) == 2 && secs < 5, buf);
}

// One rank's operands of its E_local expert GEMMs for cuBLASLt: A [E_local][rows, k], B
// [E_local][k, n] (FP8: w_t [E_local][n, k], e4m3) and its FP8 per-tensor scales.
struct ExpertOperands {
  void const* a;
  void const* w;
  CublasLt::Fp8Scales scales;
};

// cuBLASLt (XLA's GEMM library) on every rank's expert GEMMs, one after another into one scratch
// output: median ms, NaN where it is not loaded or refuses a GEMM. Expert e's A starts at row e *
// rows; its GEMM multiplies the first m rows (m < rows: the rows of a packed layout's expert).
float cublas_experts_ms(CublasLt const* lt, std::vector<ExpertOperands> const& ranks, int e_local, int rows, int n,
                        int k, int in_bytes, bool fp8, cudaStream_t stream, int m = 0) {
  if (m == 0) m = rows;
  if (!lt) return NAN;
  uint16_t* scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&scratch, size_t(rows) * n * 2));
  std::vector<std::function<void()>> gemms;
  for (ExpertOperands const& r : ranks) {
    for (int e = 0; e < e_local; ++e) {
      gemms.push_back(lt->gemm(m, n, k, static_cast<char const*>(r.a) + int64_t(e) * rows * k * in_bytes,
                               static_cast<char const*>(r.w) + int64_t(e) * k * n * in_bytes, scratch, stream,
                               fp8 ? &r.scales : nullptr));
    }
  }
  bool const all = std::all_of(gemms.begin(), gemms.end(), [](auto const& g) { return bool(g); });
  float const ms = all ? median_ms([&] { for (auto const& g : gemms) g(); }, stream, 3, 20) : NAN;
  CHECK_CUDA(cudaFree(scratch));
  return ms;
}

// moe_gemm_combine's rows of `moe bench` (the down projection of the dispatch's shapes), each a
// CUDA graph of every rank's work, replayed in interleaved rounds (each replay advances the epoch):
//   fused_ms: the op as run_moe_combine runs it: each rank's GEMM stores its blocks into the
//     sources' inboxes and releases each segment, then its wait kernel and the copy of its inbox
//     into o_recv;
//   seq_ms: the same GEMM kernel storing into a local staging buffer (flags released as in the op,
//     nobody waits for them), then on the rank's stream one cudaMemcpyAsync per destination (its
//     own included) of its rows into that destination's o_recv: the GEMM, then the all-to-all;
//   gemm_ms: those GEMMs alone (no move).
// All ranks share this GPU: a peer's inbox is this GPU's HBM, so the fused stores move nothing over
// NVLink, and both columns copy the same bytes per rank (the copy out, or the move).
int moe_combine_bench(CublasLt const* lt) {
  std::printf("# moe_gemm_combine (h [E/W, W*C, F] x w2 [E/W, F, H] -> o_recv [E, C, H] at every source), W ranks on one H200,\n"
              "# bf16 and e4m3 -> bf16; median ms of one call of every rank (graph replays): fused_ms: GEMM storing into the\n"
              "# sources' inboxes + wait + copy out; seq_ms: the GEMM storing locally, then its rows copied to every o_recv;\n"
              "# gemm_ms: that GEMM alone; cublas_ms: cuBLASLt on every rank's expert GEMMs [W*C, F] x [F, H], one after another\n");
  std::printf("%-64s %9s %9s %9s %9s %8s %8s\n", "case", "fused_ms", "seq_ms", "gemm_ms", "cublas_ms", "seq/fus",
              "cub/fus");
  struct Shape {
    int world, experts, capacity, f, n;
  };
  // Mixtral-8x7B's down projection (F 14336, H 4096), the DeepSeek-V3-like experts (F 2048, H 7168)
  // and W = 4, at the dispatch rows' capacities.
  Shape const shapes[] = {{2, 8, 1024, 14336, 4096}, {2, 16, 256, 2048, 7168}, {4, 8, 512, 4096, 4096}};
  int bad = 0;
  for (Shape const sh : shapes) {
    for (int fp8 : {0, 1}) {
      CombineWorld world(sh.world, sh.experts, sh.capacity, sh.f, sh.n, fp8 ? 128 : 256, true, fp8);
      if (world.plan.error) {
        std::printf("%-64s plan refused: %s\n", world.name().c_str(), world.plan.error);
        ++bad;
        continue;
      }
      world.allocate_stage();
      world.fill_inputs(31);
      cudaStream_t origin;
      CHECK_CUDA(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
      using Part = CombineWorld::Part;
      cudaGraphExec_t graphs[3];
      Part const parts[3] = {Part::kCall, Part::kLocalGemmsThenMove, Part::kLocalGemms};
      for (int i = 0; i < 3; ++i) {
        world.part = parts[i];
        graphs[i] = world.capture(origin);
      }
      world.part = Part::kCall;
      std::vector<std::function<void()>> replays;
      for (cudaGraphExec_t g : graphs) replays.push_back([&origin, g] { CHECK_CUDA(cudaGraphLaunch(g, origin)); });
      std::vector<float> const ms = interleaved_median_ms(replays, origin, 3, 10, 3);
      std::vector<ExpertOperands> operands;
      for (auto& r : world.ranks) operands.push_back({r.h, r.w, {r.scales, r.scales + 1}});
      float const cublas_ms = cublas_experts_ms(lt, operands, world.plan.e_local, sh.world * sh.capacity, sh.n,
                                                sh.f, element_bytes(world.input), fp8 != 0, origin);
      // What was timed computed the same rows: the fused call's o_recv (inboxes poisoned first, so a
      // missing wait or store shows) bitwise the sequence's (same GEMM, same order); `moe test`
      // holds the kernels to float64.
      auto run = [&](cudaGraphExec_t exec) {
        world.poison();
        CHECK_CUDA(cudaGraphLaunch(exec, origin));
        CHECK_CUDA(cudaStreamSynchronize(origin));
        return world.outputs();
      };
      auto const fused = run(graphs[0]);
      bool const same = run(graphs[1]) == fused;
      // A row both left unstored would compare equal: no poison may be left in the fused rows.
      bool stored = true;
      for (auto const& rows : fused) stored = stored && std::find(rows.begin(), rows.end(), uint16_t(0xFFFF)) == rows.end();
      DeviceError const e = world.read_error();
      bool const ok = same && stored && e.code == 0;
      bad += !ok;
      std::printf("%-64s %9.3f %9.3f %9.3f %9.3f %8.3f %8.3f%s\n", world.name().c_str(), ms[0], ms[1], ms[2], cublas_ms,
                  ms[1] / ms[0], cublas_ms / ms[0], ok ? "" : "  FUSED != SEQUENCE OR DEVICE ERROR");
      for (cudaGraphExec_t g : graphs) CHECK_CUDA(cudaGraphExecDestroy(g));
      CHECK_CUDA(cudaStreamDestroy(origin));
    }
  }
  return bad;
}

// Every rank's call as one CUDA graph, replayed in interleaved rounds: fused (each GEMM takes a
// segment as soon as it has landed), the same kernels in sequence (every transfer and the receiver's
// wait, then the GEMM), the GEMMs alone (every segment already in place: flags at the largest stamp),
// the whole call with its flags so (nowait) and the transfers alone. All W ranks share this GPU, so
// a call's time is every rank's work on one GPU, and a push is HBM to HBM: the overlap measured is of GEMM and copy on shared SMs and memory,
// not of GEMM and NVLink. cuBLASLt times the same expert GEMMs, one after another (LD_LIBRARY_PATH
// must find libcublasLt.so.13; the column is NaN otherwise). Then moe_combine_bench's rows.
int moe_bench_main() {
  CHECK_CUDA(moe::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt* lt = CublasLt::load();
  std::printf("# moe_dispatch_gemm, W ranks on one H200, bf16 (and e4m3 -> bf16); median ms of one call of every rank (graph replays);\n"
              "# cublas_ms: cuBLASLt's fastest algorithm on every rank's expert GEMMs [W*C, K] x [K, N], one after another\n"
              "# (rows=R: R rows of every segment sent, the rest skipped; cuBLASLt on [W*R, K] per expert, as if packed)\n");
  std::printf("%-52s %9s %9s %9s %9s %9s %9s %8s %8s %8s\n", "case", "fused_ms", "seq_ms", "gemm_ms", "nowait_ms",
              "xfer_ms", "cublas_ms", "seq/fus", "fus/gemm", "cub/gemm");
  struct Shape {
    int world, experts, capacity, k, n;
  };
  // Mixtral-8x7B's gate|up (H 4096, 2 x F 14336) at capacity factor 1 of 4096 tokens per rank,
  // DeepSeek-V3-like experts (H 7168, 2 x 2048) scaled to 16 experts, and W = 4.
  Shape const shapes[] = {{2, 8, 1024, 4096, 28672}, {2, 16, 256, 7168, 4096}, {4, 8, 512, 4096, 8192}};
  int bad = 0;
  for (Shape const sh : shapes) {
    // The copy engines and the SM push in bf16, then FP8 (e4m3 x e4m3 into bf16, 128-wide blocks);
    // then bf16 and FP8 with a quarter of every segment's rows sent (a dropless capacity when E / k
    // = 4, as Mixtral's: the blocks past them skipped; the copy engines move whole segments), and
    // bf16 so with the SM push, which moves only the rows sent; then bf16 with an eighth of the rows
    // (E / k = 8), both pushes.
    for (int variant : {0, 1, 2, 3, 4, 5, 6, 7}) {
      int const push_sms = variant == 1 || variant == 5 || variant == 7 ? 8 : 0;
      bool const fp8 = variant == 2 || variant == 4;
      MoeCase c{sh.world, sh.experts, sh.capacity, sh.k, sh.n, moe_config_for(sh.world, fp8 ? 128 : 256, 8, push_sms)};
      c.fp8 = fp8 ? 1 : 0;
      c.rows = variant >= 6 ? sh.capacity / 8 : variant >= 3 ? sh.capacity / 4 : 0;
      MoeWorld world(c);
      world.fill_inputs(21);
      cudaStream_t origin;
      CHECK_CUDA(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
      cudaGraphExec_t const fused = world.capture(origin);
      cudaGraphExec_t const sequence = capture_call(origin, world.streams(), world.epoch_word, [&] {
        world.part = MoeWorld::Part::kTransfers;
        world.enqueue(-1);
        world.part = MoeWorld::Part::kGemms;
        world.enqueue(-1);
      });
      world.part = MoeWorld::Part::kTransfers;
      cudaGraphExec_t const transfers = world.capture(origin);
      world.part = MoeWorld::Part::kGemms;
      cudaGraphExec_t const gemms = world.capture(origin);
      world.part = MoeWorld::Part::kCall;
      auto replay = [&](cudaGraphExec_t exec) {
        return [&, exec]() {
          CHECK_CUDA(cudaGraphLaunch(exec, origin));
          ++world.epoch;
        };
      };
      // Without waits: every flag at the largest stamp (it passes any wait, whatever its epoch) for
      // the one replay, zero again after it, so the next replay's waits are honest. The GEMMs alone
      // run so; `nowait` is the whole call so (the transfers beside the GEMMs, no GEMM waits): above
      // `gemm`, the GEMMs lose to sharing the GPU with the copies; fused above `nowait`, they wait.
      auto without_waits = [&](cudaGraphExec_t exec) {
        return [&, exec]() {
          for (auto& r : world.ranks)
            CHECK_CUDA(cudaMemsetAsync(r.flags, 0xFF, 2 * world.plan.flags * sizeof(uint64_t), origin));
          replay(exec)();
          for (auto& r : world.ranks)
            CHECK_CUDA(cudaMemsetAsync(r.flags, 0, 2 * world.plan.flags * sizeof(uint64_t), origin));
        };
      };
      std::vector<float> const ms = interleaved_median_ms(
          {replay(fused), replay(sequence), replay(transfers), without_waits(gemms), without_waits(fused)}, origin, 3,
          10, 3);
      float const gemm_ms = ms[3];
      // The same GEMMs by cuBLASLt: expert e's A is its inbox block [W*C, K] (the inbox is
      // expert-major).
      std::vector<ExpertOperands> operands;
      for (auto& r : world.ranks) operands.push_back({r.inbox, r.w, {r.x_scales, r.x_scales + c.world}});
      // With c.rows: cuBLASLt on the rows sent alone, each expert's W * rows as if packed (the GEMM
      // work a layout without per-segment padding would do).
      float const cublas_ms = cublas_experts_ms(lt, operands, c.e_local(), sh.world * sh.capacity, sh.n, sh.k,
                                                c.in_bytes(), c.fp8 != 0, origin, sh.world * (c.rows ? c.rows : sh.capacity));
      // What was timed computed the same y: the fused call's bitwise the sequence's (same GEMM, same
      // order; `moe test` holds the kernels to float64).
      auto run = [&](cudaGraphExec_t exec) {
        world.poison_outputs();
        CHECK_CUDA(cudaGraphLaunch(exec, origin));
        CHECK_CUDA(cudaStreamSynchronize(origin));
        ++world.epoch;
        return world.outputs();
      };
      bool const same = run(sequence) == run(fused);
      DeviceError const e = world.read_error();
      bool const ok = same && e.code == 0;
      bad += !ok;
      std::printf("%-52s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %8.3f %8.3f %8.3f%s\n", describe(c).c_str(), ms[0], ms[1],
                  gemm_ms, ms[4], ms[2], cublas_ms, ms[1] / ms[0], ms[0] / gemm_ms, cublas_ms / gemm_ms,
                  ok ? "" : "  FUSED != SEQUENCE OR DEVICE ERROR");
      for (cudaGraphExec_t g : {fused, sequence, transfers, gemms}) CHECK_CUDA(cudaGraphExecDestroy(g));
      CHECK_CUDA(cudaStreamDestroy(origin));
    }
  }
  bad += moe_combine_bench(lt);
  return bad == 0 ? 0 : 1;
}

int moe_test_main() {
  CHECK_CUDA(moe::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  // The plan refuses a capacity whose tiles would straddle two sources.
  {
    MoeCase const bad{2, 4, 192, 256, 256, moe_config_for(2, 128)};
    char const* const err = moe_plan(bad.problem(0), bad.config).error;
    expect(err != nullptr, describe(bad) + ": plan error \"" + (err ? err : "none") + "\"");
  }
  for (int world : {1, 2, 3, 4}) {
    for (int experts : {world, 2 * world}) {
      for (int capacity : {128, 256}) {
        run_moe_case(MoeCase{world, experts, capacity, 256, 512, moe_config_for(world, capacity == 128 ? 128 : 256)}, 3);
      }
    }
  }
  // A K tail inside a k-tile (TMA zero-fills it), narrow blocks, raster groups smaller than a
  // segment, three tile rows per segment, a longer K.
  run_moe_case(MoeCase{2, 4, 128, 200, 384, moe_config_for(2, 128)}, 2);
  run_moe_case(MoeCase{3, 6, 384, 1024, 512, moe_config_for(3, 256, 2)}, 2);
  run_moe_case(MoeCase{4, 8, 256, 512, 1024, moe_config_for(4, 256, 1)}, 2);
  MoeCase half{2, 4, 256, 256, 512, moe_config_for(2, 256)};
  half.bf16 = false;
  run_moe_case(half, 2);
  // The SM push: every world, one CTA or more than a segment has vectors for (the plan caps it),
  // several experts per rank.
  for (int world : {2, 3, 4}) {
    run_moe_case(MoeCase{world, 2 * world, 256, 256, 512, moe_config_for(world, 256, 8, 4)}, 3);
  }
  run_moe_case(MoeCase{2, 6, 128, 200, 384, moe_config_for(2, 128, 2, 1)}, 2);
  run_moe_case(MoeCase{4, 4, 384, 1024, 512, moe_config_for(4, 256, 8, 16)}, 2);
  // Ragged segments (MoeGemmArgs::received: empty, partial and full, x_send random past the rows
  // sent): the blocks past them are zeros; W = 1-4, both pushes, both block widths, FP8 and fp16.
  for (int world : {1, 2, 3, 4}) {
    MoeCase rc{world, 2 * world, 384, 256, 512, moe_config_for(world, world == 3 ? 128 : 256, 8, world == 2 ? 4 : 0)};
    rc.rows = kMixedRows;
    run_moe_case(rc, 3);
  }
  // The SM push moves only the rows sent (whole 128-row blocks of them): the inbox past them holds
  // the last epoch's rows, which no computed block may read; W = 3 and 4, FP8, a K tail.
  for (int world : {3, 4}) {
    MoeCase rp{world, 2 * world, 384, 256, 512, moe_config_for(world, world == 3 ? 128 : 256, 8, 4)};
    rp.rows = kMixedRows;
    run_moe_case(rp, 3);
  }
  {
    MoeCase rp{3, 6, 256, 272, 384, moe_config_for(3, 128, 8, 2)};
    rp.rows = kMixedRows;
    rp.fp8 = 2;
    run_moe_case(rp, 3);
    MoeCase rk{2, 4, 384, 200, 256, moe_config_for(2, 128, 2, 1)};
    rk.rows = kMixedRows;
    run_moe_case(rk, 3);
  }
  {
    MoeCase rc{3, 6, 256, 272, 384, moe_config_for(3, 128)};
    rc.rows = kMixedRows;
    rc.fp8 = 1;
    run_moe_case(rc, 2);
    MoeCase rh{2, 4, 384, 256, 256, moe_config_for(2, 128, 2)};
    rh.rows = kMixedRows;
    rh.bf16 = false;
    run_moe_case(rh, 2);
    // A grid of 5 CTAs over 12 segments: each role's cursor walks many segments per call.
    MoeCase rs{3, 12, 384, 256, 512, MoeConfig{256, 5, 2, 0}};
    rs.rows = kMixedRows;
    run_moe_case(rs, 3);
  }
  // FP8 per tensor (128-wide blocks; each source's rows scaled by its own x scale): e4m3 into bf16
  // and fp16, e5m2 x (a gradient's dispatch), both pushes, a K tail inside a k-tile.
  for (int world : {2, 3, 4}) {
    MoeCase f8{world, 2 * world, 128, world == 2 ? 272 : 256, 384, moe_config_for(world, 128, 8, world == 3 ? 4 : 0)};
    f8.fp8 = world == 4 ? 2 : 1;
    f8.bf16 = world != 3;
    run_moe_case(f8, 2);
  }
  for (int world : {2, 3, 4}) {
    run_moe_transfer(world, 2 * world, 0);
    run_moe_transfer(world, world, 4);
  }
  // moe_gemm_combine's GEMM: W = 1-4, several experts per rank, three tile rows per segment, both
  // block widths, a K (F) tail inside a k-tile, fp16.
  run_moe_combine(1, 2, 128, 256, 256, 128);
  run_moe_combine(2, 4, 128, 256, 512, 256);
  run_moe_combine(3, 6, 384, 200, 256, 128);
  run_moe_combine(4, 4, 256, 512, 384, 128, false);
  // FP8 per tensor (128-wide blocks, one alpha from the rank's two scales): e4m3 into bf16 and fp16,
  // e5m2 h (the dispatch's backward), a K (F) tail.
  run_moe_combine(2, 4, 128, 256, 384, 128, true, 1);
  run_moe_combine(3, 6, 256, 272, 256, 128, false, 1);
  run_moe_combine(4, 8, 128, 256, 512, 128, true, 2);
  // Ragged segments (MoeCombineArgs::received): the blocks past the rows read back are neither
  // multiplied nor sent (the sources' poison stays there); W = 1-4, FP8.
  run_moe_combine(1, 2, 384, 256, 256, 128, true, 0, kMixedRows);
  run_moe_combine(2, 4, 384, 256, 512, 256, true, 0, kMixedRows);
  run_moe_combine(3, 6, 256, 200, 256, 128, false, 0, kMixedRows);
  run_moe_combine(4, 8, 384, 256, 384, 128, true, 1, kMixedRows);
  run_moe_deadline(2, 4);
  run_moe_deadline(3, 3);
  run_moe_deadline(4, 8);
  run_moe_deadline(3, 6, 4);
  run_graph<MoeWorld>(MoeCase{2, 4, 128, 256, 256, moe_config_for(2, 128)}, 4);
  run_graph<MoeWorld>(MoeCase{3, 6, 256, 320, 512, moe_config_for(3, 256)}, 4);
  run_graph<MoeWorld>(MoeCase{2, 4, 256, 256, 512, moe_config_for(2, 256, 8, 4)}, 4);
  std::printf("harness moe test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace entwine::harness
