// gemm_rs's benchmarks: `bench` (fused one-rank grid sweep, the producer alone against cuBLASLt,
// consumer bandwidth), `producer` (a few launches for ncu) and `energy` (steady-state time, board
// power and energy per GEMM under the power cap, through NVML).
#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "harness/gemm_rs_world.h"

namespace entwine::harness {

// NVML, loaded at run time: the board's energy counter (mJ) and the SM clock, for the energy mode.
struct Nvml {
  using Init = int (*)();
  using ByPci = int (*)(char const*, void**);
  using Energy = int (*)(void*, unsigned long long*);
  using Clock = int (*)(void*, int, unsigned*);
  void* device = nullptr;
  Energy energy = nullptr;
  Clock clock = nullptr;

  static Nvml const* load() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    static Nvml nv;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    auto by_pci = reinterpret_cast<ByPci>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    nv.energy = reinterpret_cast<Energy>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    nv.clock = reinterpret_cast<Clock>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    char bus[32];
    CHECK_CUDA(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
    if (!init || !by_pci || !nv.energy || !nv.clock || init() != 0 || by_pci(bus, &nv.device) != 0) return nullptr;
    return &nv;
  }
  unsigned long long millijoules() const {
    unsigned long long mj = 0;
    energy(device, &mj);
    return mj;
  }
  unsigned sm_mhz() const {
    unsigned mhz = 0;
    clock(device, 1 /* NVML_CLOCK_SM */, &mhz);
    return mhz;
  }
  // The first counter update after now: (host seconds, mJ) at an update boundary, so that a window
  // between two boundaries does not depend on how often the counter updates.
  std::pair<double, unsigned long long> next_update() const {
    unsigned long long const start = millijoules();
    unsigned long long now = start;
    while (now == start) now = millijoules();
    return {host_seconds(), now};
  }
};

// One launcher alone, back to back for `seconds` after a 0.3 s ramp (the power cap's steady state),
// measured over the window after the ramp: ms per launch (GPU time between two events that the
// feeder records at batch boundaries), the mean board power (energy counter between two updates)
// and the mean SM clock.
struct SteadyState {
  double ms, watts, mhz;
};
SteadyState steady_state(Nvml const& nv, std::function<void()> const& launch, float est_ms, cudaStream_t stream,
                         double seconds) {
  // A feeder thread keeps at most two batches of ~20 ms in flight, so the GPU never idles and the
  // queue drains quickly when the window ends. Asked to, it records a timing event after its next
  // batch: marks 0 and 1 bound the window's launches.
  int const batch = std::max(1, int(20.0f / est_ms));
  std::atomic<bool> stop{false};
  std::atomic<int> marks_wanted{0}, marks_done{0};
  long mark_launches[2] = {0, 0};
  cudaEvent_t mark[2], in_flight[2];
  for (auto& e : mark) CHECK_CUDA(cudaEventCreate(&e));
  for (auto& e : in_flight) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::thread feeder([&] {
    // This thread's first CUDA call makes the device's primary context current here; the producer's
    // launch encodes TMA descriptors through the driver API, which needs it.
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(nullptr));
    long launched = 0;
    for (long i = 0; !stop.load(); ++i) {
      if (i >= 2) CHECK_CUDA(cudaEventSynchronize(in_flight[i % 2]));
      for (int j = 0; j < batch; ++j) launch();
      CHECK_CUDA(cudaEventRecord(in_flight[i % 2], stream));
      launched += batch;
      int const m = marks_done.load();
      if (m < marks_wanted.load()) {
        CHECK_CUDA(cudaEventRecord(mark[m], stream));
        mark_launches[m] = launched;
        marks_done = m + 1;
      }
    }
  });
  auto wait_for_mark = [&](int m) {
    marks_wanted = m + 1;
    while (marks_done.load() <= m) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  wait_for_mark(0);
  auto const [t0, e0] = nv.next_update();
  double mhz = 0;
  int samples = 0;
  for (double t = t0; t < t0 + seconds; t = host_seconds()) {
    mhz += nv.sm_mhz();
    ++samples;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto const [t1, e1] = nv.next_update();
  wait_for_mark(1);
  stop = true;
  feeder.join();
  CHECK_CUDA(cudaEventSynchronize(mark[1]));
  float window_ms;
  CHECK_CUDA(cudaEventElapsedTime(&window_ms, mark[0], mark[1]));
  for (auto e : {mark[0], mark[1], in_flight[0], in_flight[1]}) cudaEventDestroy(e);
  return {window_ms / double(mark_launches[1] - mark_launches[0]), double(e1 - e0) / (t1 - t0) / 1e3, mhz / samples};
}

// Two passes over the launchers in rotated order, each launcher alone in its steady state.
std::vector<std::vector<SteadyState>> steady_passes(Nvml const& nv, std::vector<std::function<void()>> const& launches,
                                                    cudaStream_t stream, double seconds) {
  std::vector<float> const est = interleaved_median_ms(launches, stream, 3, 5, 3);
  std::vector<std::vector<SteadyState>> runs(launches.size());
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t j = 0; j < launches.size(); ++j) {
      size_t const i = (j + pass * launches.size() / 2) % launches.size();
      runs[i].push_back(steady_state(nv, launches[i], est[i], stream, seconds));
    }
  }
  return runs;
}

// Energy per GEMM under the power cap, each launcher alone in its steady state.
//   energy M N K [seconds] [names]: the shipped producer, two variants that move more or fewer bytes
//     and every cuBLASLt algorithm the heuristic offers (names: one launch of each, in order, for ncu);
//   energy suite [seconds] [shapes]: the design suite (or its first `shapes` shapes), the producer
//     without and with the interleaved order and the flags (and with raster groups of 16 rows)
//     against cuBLASLt's fastest algorithm, one line per shape.
int energy_main(bool suite, std::vector<std::array<int, 3>> const& shapes, double seconds, bool names_only) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  Nvml const* nv = names_only ? nullptr : Nvml::load();
  if (!names_only && !nv) {
    std::fprintf(stderr, "libnvidia-ml.so.1 not found: no energy counter\n");
    return 2;
  }
  CublasLt const* cublas = CublasLt::load();
  if (!cublas) {
    std::fprintf(stderr, "libcublasLt.so.13 not found\n");
    return 2;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int const sms = prop.multiProcessorCount;
  struct Variant {
    char const* name;
    int block_n, raster_rows;
    bool interleave, publish;
  };
  std::vector<Variant> const variants =
      suite ? std::vector<Variant>{{"plain r8", 256, 8, false, false},
                                   {"inter r8", 256, 8, true, false},
                                   {"inter+flags r8 (shipped)", 256, 8, true, true},
                                   {"inter+flags r16", 256, 16, true, true}}
            : std::vector<Variant>{{"n256 inter+flags r8 (shipped)", 256, 8, true, true},
                                   {"n256 plain r1", 256, 1, false, false},
                                   {"n128 inter+flags r8", 128, 8, true, true}};
  if (suite) {
    std::printf("producer alone (W=2, bf16) and cuBLASLt's fastest algorithm, each alone for %.1f s after a 0.3 s ramp,\n"
                "two passes; ms per GEMM (mean of the passes), shipped's and cuBLASLt's board W and SM MHz\n", seconds);
    std::printf("%6s %6s %5s | %8s | %8s | %8s | %8s | %8s | %13s | %13s | %s\n", "M", "N", "K", "plain r8", "inter r8",
                "shipped", "r16", "cuBLASLt", "shipped W/MHz", "cuBLAS W/MHz", "cuBLASLt / shipped");
  }
  for (auto const& sh : shapes) {
    Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}};
    World world(c);
    world.fill_inputs(3);
    ProblemShape s{c.m, c.n, c.k, 2, 0};
    std::vector<std::string> names;
    std::vector<std::function<void()>> launches;
    for (auto const& v : variants) {
      names.push_back(v.name);
      launches.push_back(producer_launcher(world, s, GemmRsConfig{v.block_n, sms, 16, 512, v.raster_rows}, v.interleave,
                                           v.publish, stream));
    }
    void const* x = world.ranks[0].x;
    void const* w = world.ranks[0].w;
    void* y = world.ranks[0].partial[1];
    if (suite) {
      names.push_back("cuBLASLt (fastest algo)");
      launches.push_back(cublas->gemm(c.m, c.n, c.k, x, w, y, stream));
    } else {
      std::vector<std::function<void()>> const algos = cublas->candidates(c.m, c.n, c.k, x, w, y, stream);
      for (size_t i = 0; i < algos.size(); ++i) {
        names.push_back("cuBLASLt algo " + std::to_string(i));
        launches.push_back(algos[i]);
      }
    }
    if (names_only) {
      for (size_t i = 0; i < launches.size(); ++i) {
        std::printf("launch %zu: %s\n", i, names[i].c_str());
        launches[i]();
        CHECK_CUDA(cudaStreamSynchronize(stream));
      }
      continue;
    }
    std::vector<std::vector<SteadyState>> const runs = steady_passes(*nv, launches, stream, seconds);
    if (suite) {
      auto mean = [&](size_t i, double SteadyState::*field) { return (runs[i][0].*field + runs[i][1].*field) / 2; };
      size_t const shipped = 2, lt = launches.size() - 1;  // the variants' third; cuBLASLt last
      std::printf("%6d %6d %5d", c.m, c.n, c.k);
      for (size_t i = 0; i < launches.size(); ++i) std::printf(" | %8.4f", mean(i, &SteadyState::ms));
      std::printf(" | %6.0f %6.0f | %6.0f %6.0f | %.3f\n", mean(shipped, &SteadyState::watts), mean(shipped, &SteadyState::mhz),
                  mean(lt, &SteadyState::watts), mean(lt, &SteadyState::mhz),
                  mean(lt, &SteadyState::ms) / mean(shipped, &SteadyState::ms));
    } else {
      double const gflop = 2.0 * c.m * c.n * c.k / 1e9;
      std::printf("%dx%dx%d bf16, each launcher alone for %.1f s after a 0.3 s ramp, two passes (rotated):\n", c.m, c.n,
                  c.k, seconds);
      std::printf("%-32s %9s %8s %8s %9s %9s\n", "launcher", "ms", "TFLOP/s", "W", "SM MHz", "mJ/GEMM");
      for (size_t i = 0; i < launches.size(); ++i) {
        for (auto const& r : runs[i]) {
          std::printf("%-32s %9.4f %8.0f %8.1f %9.0f %9.2f\n", names[i].c_str(), r.ms, gflop / r.ms, r.watts, r.mhz,
                      r.watts * r.ms);
        }
      }
    }
  }
  return 0;
}

// A few producer launches of one shape, for ncu: producer M N K block_n producer_sms raster_rows
// [plain] (plain: row-major partitions without flags, else interleaved with flags).
int producer_main(int argc, char** argv) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  int const m = std::atoi(argv[2]), n = std::atoi(argv[3]), k = std::atoi(argv[4]);
  GemmRsConfig cfg{std::atoi(argv[5]), std::atoi(argv[6]), 16, 512, std::atoi(argv[7])};
  Case c{m, n, k, 2, true, cfg};
  World world(c);
  world.fill_inputs(3);
  ProblemShape s{m, n, k, 2, 0};
  bool const interleave_and_publish = !(argc > 8 && std::string(argv[8]) == "plain");
  std::function<void()> launch = producer_launcher(world, s, cfg, interleave_and_publish, interleave_and_publish, 0);
  for (int i = 0; i < 3; ++i) launch();
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}

// Producer and consumer of one rank (W = 1) run together as the FFI handler runs them (forked from
// a main stream, consumer first on the high-priority stream, joined back): the on-GPU interaction
// of the two kernels without NVLink. Prints end-to-end ms per (x, producer_sms) next to the
// producer alone.
void bench_fused_one_rank(FILE* out, int sms) {
  std::printf("\nfused, one rank (W=1, bf16, r8): end-to-end ms per block width, consumer grid x and producer grid\n");
  for (auto const& sh : {std::array<int, 3>{8192, 8192, 1024}, std::array<int, 3>{8192, 8192, 3584}}) {
    Case c{sh[0], sh[1], sh[2], 1, true, GemmRsConfig{}};
    World world(c);
    world.timeout_ns = 2'000'000'000ull;
    world.fill_inputs(11);
    ProblemShape s{c.m, c.n, c.k, 1, 0};
    auto& r = world.ranks[0];
    cudaStream_t main_stream;
    cudaEvent_t fork, producer_done, consumer_done;
    CHECK_CUDA(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&producer_done, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&consumer_done, cudaEventDisableTiming));
    std::printf("%5d %5d %5d:", c.m, c.n, c.k);
    for (int block_n : {256, 128})
    for (int x : {4, 8, 16, 24}) {
      for (int producer_sms : {0, sms - x, sms}) {
        GemmRsConfig cfg{block_n, producer_sms, x, 512, 8};
        GemmRsPlan const plan = Case::plan_of(s, cfg);
        auto call = [&](bool with_consumer) {
          CHECK_CUDA(cudaEventRecord(fork, main_stream));
          CHECK_CUDA(cudaStreamWaitEvent(r.producer_stream, fork, 0));
          CHECK_CUDA(cudaStreamWaitEvent(r.consumer_stream, fork, 0));
          if (with_consumer) {
            CHECK_CUDA(launch_consumer(DType::kBF16, plan, world.consumer_args(0), r.consumer_stream, false));
          }
          CHECK_CUDA(gemm_rs::launch_gemm(DType::kBF16, DType::kBF16, plan, world.producer_args(0), r.producer_stream));
          CHECK_CUDA(cudaEventRecord(producer_done, r.producer_stream));
          CHECK_CUDA(cudaEventRecord(consumer_done, r.consumer_stream));
          CHECK_CUDA(cudaStreamWaitEvent(main_stream, producer_done, 0));
          CHECK_CUDA(cudaStreamWaitEvent(main_stream, consumer_done, 0));
          CHECK_CUDA(comm::launch_end_call(comm::CallEnd{world.epoch_word}, main_stream));
        };
        float const alone = median_ms([&] { call(false); }, main_stream, 10, 50);
        float const fused = median_ms([&] { call(true); }, main_stream, 10, 50);
        std::printf(" n%d/x%d/p%d %.3f(%.3f)", block_n, x, producer_sms, fused, alone);
        if (out) std::fprintf(out, "{\"kind\":\"fused1\",\"m\":%d,\"n\":%d,\"k\":%d,\"block_n\":%d,\"grid\":%d,\"producer_sms\":%d,\"ms\":%.5f,\"producer_ms\":%.5f}\n", c.m, c.n, c.k, block_n, x, producer_sms, fused, alone);
      }
    }
    std::printf("\n");
    DeviceError const e = world.read_error();
    if (e.code != 0) std::printf("  device error: code %u tile %d\n", e.code, e.tile);
    cudaStreamDestroy(main_stream);
  }
}

// sections: nullptr (all) or one of "fused", "producer", "consumer".
int bench_main(char const* jsonl, char const* section) {
  auto wanted = [&](char const* name) { return section == nullptr || std::string(section) == name; };
  CHECK_CUDA(gemm_rs::prepare_kernels());
  FILE* out = jsonl ? std::fopen(jsonl, "w") : nullptr;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Copy ceiling: a large device-to-device copy, bytes read + written.
  size_t const copy_bytes = size_t(2) << 30;
  void *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
  float const copy_ms = median_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream)); }, stream, 3, 20);
  double const copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  cudaFree(src);
  cudaFree(dst);
  std::printf("device %s, %d SMs; copy bandwidth %.0f GB/s (read+write)\n", prop.name, prop.multiProcessorCount, copy_gbs);
  if (out) std::fprintf(out, "{\"kind\":\"copy\",\"gbs\":%.1f,\"device\":\"%s\",\"sms\":%d}\n", copy_gbs, prop.name, prop.multiProcessorCount);

  if (wanted("fused")) bench_fused_one_rank(out, prop.multiProcessorCount);

  // Producer alone on the design's suite (W = 2 partitions, the GEMM of one rank).
  if (wanted("producer")) {
    std::printf("\nproducer alone (W=2, bf16), median ms of 20 rounds of 5 launches, the variants interleaved; TFLOP/s\n");
    int const sms = prop.multiProcessorCount;
    struct Variant {
      char const* name;
      int block_n, producer_sms, raster_rows;
      bool interleave, publish, split = false;
    } const variants[] = {{"n256 pers plain r1", 256, sms, 1, false, false},
                          {"n256 pers plain r8", 256, sms, 8, false, false},
                          {"n256 pers inter r8", 256, sms, 8, true, false},
                          {"n256 pers inter+flags r8", 256, sms, 8, true, true},
                          {"n256 pers inter+flags r8 split", 256, sms, 8, true, true, true},
                          {"n256 pers inter+flags r16", 256, sms, 16, true, true},
                          {"n128 pers plain r8", 128, sms, 8, false, false},
                          {"n128 pers inter r8", 128, sms, 8, true, false},
                          {"n128 pers inter+flags r8", 128, sms, 8, true, true},
                          {"n256 1/CTA inter+flags r8", 256, 0, 8, true, true}};
    // The shipped configuration; plain r8 vs inter r8 is the order's cost, inter r8 vs shipped the flags'.
    size_t const shipped = std::find_if(std::begin(variants), std::end(variants), [](auto const& v) {
                             return std::strcmp(v.name, "n256 pers inter+flags r8") == 0;
                           }) - std::begin(variants);
    CublasLt const* cublas = CublasLt::load();
    if (!cublas) std::printf("(libcublasLt.so.13 not found: no cuBLAS column)\n");
    std::printf("%6s %6s %5s", "M", "N", "K");
    for (auto const& v : variants) std::printf(" | %-25s", v.name);
    if (cublas) std::printf(" | %-25s | %s", "cuBLASLt (fastest algo)", "cuBLAS/shipped");
    std::printf("\n");
    for (auto const& sh : kDesignSuite) {
      Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}};
      World world(c);
      world.fill_inputs(3);
      ProblemShape s{c.m, c.n, c.k, 2, 0};
      double const flop = 2.0 * c.m * c.n * c.k;
      std::printf("%6d %6d %5d", c.m, c.n, c.k);
      std::vector<std::function<void()>> launches;
      for (auto const& v : variants) {
        GemmRsConfig const cfg{v.block_n, v.producer_sms, 16, 512, v.raster_rows, v.split};
        launches.push_back(producer_launcher(world, s, cfg, v.interleave, v.publish, stream));
      }
      if (cublas) {
        void const* x = world.ranks[0].x;
        void const* w = world.ranks[0].w;
        void* y = world.ranks[0].partial[1];
        launches.push_back(cublas->gemm(c.m, c.n, c.k, x, w, y, stream));
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream);
      for (size_t i = 0; i < ms.size(); ++i) {
        char const* name = i < std::size(variants) ? variants[i].name : "cublas";
        std::printf(" | %7.3f ms %4.0f TF/s      ", ms[i], flop / (ms[i] * 1e-3) / 1e12);
        if (out) std::fprintf(out, "{\"kind\":\"producer\",\"variant\":\"%s\",\"m\":%d,\"n\":%d,\"k\":%d,\"ms\":%.5f}\n", name, c.m, c.n, c.k, ms[i]);
      }
      if (cublas) std::printf(" | %.3f", ms.back() / ms[shipped]);
      std::printf("\n");
    }
  }

  // Consumer alone with every flag already released: bandwidth vs grid x and block b.
  if (wanted("consumer")) {
    std::printf("\nconsumer alone, inputs ready (bf16, M/W x N = 8192 x 8192 reduced rows), GB/s (read+write)\n");
    for (int world_size : {2, 4, 8}) {
      Case c{8192 * world_size, 8192, 8, world_size, true, GemmRsConfig{}};
      World world(c);
      ProblemShape s{c.m, c.n, c.k, world_size, 0};
      std::vector<uint64_t> ones(2 * size_t(world.flags_per_parity), 1);  // both parities released
      CHECK_CUDA(cudaMemcpy(world.ranks[0].flags, ones.data(), ones.size() * 8, cudaMemcpyHostToDevice));
      world.fill_inputs(5);
      for (int r = 0; r < world_size; ++r)
        CHECK_CUDA(cudaMemcpy(world.ranks[r].partial[0], world.ranks[r].x, size_t(c.m) * c.k * 2, cudaMemcpyDeviceToDevice));
      CHECK_CUDA(cudaDeviceSynchronize());
      double const bytes = double(world_size + 1) * (c.m / world_size) * double(c.n) * 2;
      std::printf("W=%d:", world_size);
      for (int block_n : {128, 256})
      for (int b : {128, 256, 512}) {
        for (int x : {8, 16, 32, 64, 132}) {
          GemmRsConfig cfg{block_n, 0, x, b};
          GemmRsPlan const plan = Case::plan_of(s, cfg);
          world.set_epoch(1);
          ConsumerArgs a = world.consumer_args(0);
          a.timeout_ns = 1'000'000'000ull;
          float ms = median_ms([&] { CHECK_CUDA(launch_consumer(DType::kBF16, plan, a, stream, false)); }, stream);
          double gbs = bytes / (ms * 1e-3) / 1e9;
          std::printf(" n%d/b%d/x%d %.0f", block_n, b, x, gbs);
          if (out) std::fprintf(out, "{\"kind\":\"consumer\",\"block_n\":%d,\"world\":%d,\"grid\":%d,\"block\":%d,\"ms\":%.5f,\"gbs\":%.1f,\"copy_frac\":%.3f}\n", block_n, world_size, x, b, ms, gbs, gbs / copy_gbs);
        }
      }
      std::printf("\n");
    }
  }
  if (out) std::fclose(out);
  return 0;
}

}  // namespace entwine::harness
