// What the forward keeps in the caller's workspace, read back after a forward call, against the
// launch plan (src/sm90/host/fwd_plan.hpp) the backend made for it.
// The longest-first order of a varlen batch's tiles (src/sm90/fwd/tile_order.cuh): every tile of
// every sequence exactly once and nothing else, sequences by the keys they use (most first),
// within one its heads in turn and each head's query tiles heaviest first under the causal mask;
// the unused entries marked; every output row written. Split-KV's partials (split_kv.cuh): the
// plan did split, and every split wrote every row of every head.
// (The outputs' values are the forward tests' business: scripts/gpu_check.sh reruns the varlen
// ones ordered and every one with 3 splits.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/test_util.hpp"
#include "sm90/fwd/split_kv.hpp"
#include "sm90/fwd/tile_order.hpp"
#include "sm90/host/fwd_plan.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

// These tests read the workspace as the 128:bf16 kernel's launcher lays it out.
constexpr Kernel kKernel{128, 128, DType::kBF16};
bool kernel_built() {
  return kernel_listed(parse_kernel_list(FA4_SM90_BUILT_KERNELS, "FA4_SM90_BUILT_KERNELS"),
                       kKernel.dim_qk, kKernel.dim_v, kKernel.dtype);
}

// The facts the backend plans with, asked of this device.
sm90::DeviceFacts device_facts() {
  int device = 0;
  sm90::DeviceFacts facts;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&facts.sm_count, cudaDevAttrMultiProcessorCount, device),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&facts.l2_bytes, cudaDevAttrL2CacheSize, device), cudaSuccess);
  return facts;
}

struct OrderCase {
  std::string name;
  std::vector<int32_t> lens_q, lens_k, used_k;
  int64_t heads_q, heads_kv;
  bool causal;
};

void check_order(const OrderCase& oc) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (test_overrides().longest_first == Choice::kOff) GTEST_SKIP() << "the tile order is off";
  const Kernel k = kKernel;
  if (!kernel_built()) GTEST_SKIP() << "the 128:bf16 forward kernel is not built";

  Case c = base_case(k, {"", 0, 0, 0});
  c.lens_q = oc.lens_q;
  c.lens_k = oc.lens_k;
  c.seqused_k = oc.used_k;
  c.heads_q = oc.heads_q;
  c.heads_kv = oc.heads_kv;
  c.causal = oc.causal;
  c.name = oc.name;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  poison_unused_rows(*setup);
  const Problem& p = setup->problem;
  DeviceRun run(*setup);
  ASSERT_CUDA(run.upload());
  const sm90::FwdPlan plan = sm90::plan_forward(p, device_facts(), run.overrides);
  ASSERT_TRUE(plan.ordered) << "more tiles than SMs, or the order forced";
  // The order first; split-KV's partials may follow.
  ASSERT_GE(run.workspace.bytes(), plan.workspace.bytes);
  ASSERT_LE(int64_t(plan.ordered_entries) * 4, int64_t(plan.workspace.order_bytes));
  Stream stream;
  Status status;
  // Not the 0xFF default, which reads as the −1 the unused entries must hold.
  run.workspace_poison = 0x7F;
  ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, &status));
  ASSERT_TRUE(status.ok()) << status.message;
  const std::vector<unsigned char> rows = rows_in_sequences(p, /*keys=*/false);
  const CheckResult written = check_written("out", run.out, rows);
  EXPECT_TRUE(written.ok) << written.message;

  // The scheduler's numbering, as the plan makes it.
  const int64_t kBlockM = plan.block_m;
  const int64_t group = plan.pack_group;
  const int64_t heads = plan.tile_heads;
  const int64_t num_m = plan.m_blocks;
  const int64_t entries = plan.ordered_entries;
  auto count = [group](int64_t len) { return len * group; };
  std::vector<int32_t> order(run.workspace.bytes() / 4);
  ASSERT_CUDA(run.workspace.download(order.data()));

  // Every tile the batch has, by (batch entry, head, query tile).
  std::map<std::tuple<int64_t, int64_t, int64_t>, int> expected;
  std::vector<int64_t> keys_used(size_t(p.batch));
  for (int64_t b = 0; b < p.batch; ++b) {
    keys_used[size_t(b)] = oc.used_k.empty() ? oc.lens_k[size_t(b)] : oc.used_k[size_t(b)];
    const int64_t tiles = (count(oc.lens_q[size_t(b)]) + kBlockM - 1) / kBlockM;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t m = 0; m < tiles; ++m) expected[{b, h, m}] = 0;
  }
  const int64_t total = int64_t(expected.size());
  ASSERT_LE(total, entries);

  int64_t prev_b = -1, prev_h = -1, prev_m = -1;
  std::vector<bool> seen_b(size_t(p.batch), false);
  for (int64_t e = 0; e < entries; ++e) {
    const int32_t code = order[size_t(e)];
    if (e >= total) {
      ASSERT_EQ(code, -1) << "entry " << e << " past the " << total << " tiles";
      continue;
    }
    ASSERT_GE(code, 0) << "entry " << e;
    const int64_t m_code = code % num_m, head_batch = code / num_m;
    const int64_t b = head_batch / heads, h = head_batch % heads;
    const int64_t m = oc.causal ? num_m - 1 - m_code : m_code;
    ASSERT_LT(b, p.batch) << "entry " << e;
    auto it = expected.find({b, h, m});
    ASSERT_NE(it, expected.end()) << "entry " << e << ": no tile (" << b << ", " << h << ", " << m
                                  << ")";
    ASSERT_EQ(it->second++, 0) << "entry " << e << ": tile (" << b << ", " << h << ", " << m
                               << ") twice";
    if (b != prev_b) {
      // A new sequence: never one seen before, and none with more keys than the last.
      ASSERT_FALSE(seen_b[size_t(b)]) << "entry " << e << ": sequence " << b << " split";
      seen_b[size_t(b)] = true;
      if (prev_b >= 0) {
        EXPECT_LE(keys_used[size_t(b)], keys_used[size_t(prev_b)])
            << "entry " << e << ": sequence " << b << " after " << prev_b;
      }
    } else if (h == prev_h) {
      // The same head: query tiles heaviest first under the causal mask, else in order.
      EXPECT_EQ(m, oc.causal ? prev_m - 1 : prev_m + 1) << "entry " << e;
    } else {
      EXPECT_EQ(h, prev_h + 1) << "entry " << e;
    }
    if (b != prev_b || h != prev_h) {
      const int64_t tiles = (count(oc.lens_q[size_t(b)]) + kBlockM - 1) / kBlockM;
      EXPECT_EQ(m, oc.causal ? tiles - 1 : 0) << "entry " << e << ": a head's first query tile";
    }
    prev_b = b;
    prev_h = h;
    prev_m = m;
  }
}

TEST(Sm90TileOrder, CausalGqaLongestFirst) {
  // More tiles than an H200 has SMs (the launcher orders them unforced); a zero-length sequence,
  // one with keys but no queries, a single-row one, and two with equal key counts.
  check_order({"tile_order_causal_gqa4",
               {1000, 3000, 200, 0, 2500, 129, 1, 700},
               {1000, 3000, 100, 5, 4000, 129, 700, 700},
               {},
               16,
               4,
               true});
}

TEST(Sm90TileOrder, PackedSequsedK) {
  // Decode-like: one query row per sequence, the heads packed (query_rows.cuh), seqused_k deciding
  // the keys (not the stored lengths).
  std::vector<int32_t> lens_q(300, 1), lens_k(300), used_k(300);
  for (int i = 0; i < 300; ++i) {
    lens_k[size_t(i)] = 64 + (i * 37) % 900;
    used_k[size_t(i)] = lens_k[size_t(i)] - (i % 5) * 11;
  }
  check_order({"tile_order_packed_used", lens_q, lens_k, used_k, 32, 8, false});
}

// Every split writes its partial LSE (finite, or +inf for a row without keys) for every row and
// head: `splits` forced (0: a decode step with few tiles and many keys, which the plan splits by
// itself on any GPU of more than 8 SMs).
void check_partials(const char* name, int splits) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Kernel k = kKernel;
  if (!kernel_built()) GTEST_SKIP() << "the 128:bf16 forward kernel is not built";
  Case c = base_case(k, {"", 2, 1, 5000});
  c.heads_q = 16;
  c.heads_kv = 2;
  c.name = name;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  const Problem& p = setup->problem;
  DeviceRun run(*setup);
  run.overrides = Overrides{};
  run.overrides.splits = splits;
  ASSERT_CUDA(run.upload());
  const sm90::FwdPlan plan = sm90::plan_forward(p, device_facts(), run.overrides);
  ASSERT_GE(plan.splits, 2) << plan.tiles << " tiles";
  if (splits > 0) EXPECT_EQ(plan.splits, splits);
  ASSERT_GE(run.workspace.bytes(), sm90::split_workspace_bytes(p, plan.splits));

  run.workspace_poison = 0x7F;  // 3.4e38 as a float: no LSE
  Stream stream;
  Status status;
  ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, &status));
  ASSERT_TRUE(status.ok()) << status.message;
  const CheckResult written = check_written("out", run.out, rows_in_sequences(p, false));
  EXPECT_TRUE(written.ok) << written.message;

  std::vector<float> ws(run.workspace.bytes() / sizeof(float));
  ASSERT_CUDA(run.workspace.download(ws.data()));
  const int64_t entries = int64_t(plan.splits) * p.heads_q * sm90::split_query_rows(p);
  const float* lse = ws.data() + entries * p.head_dim_v;  // after the partial O (no order: fixed)
  int64_t unwritten = 0;
  for (int64_t i = 0; i < entries; ++i)
    if (!(std::isfinite(lse[i]) && std::fabs(lse[i]) < 1e30f) && lse[i] != INFINITY) ++unwritten;
  EXPECT_EQ(unwritten, 0) << "of " << entries << " partial LSE entries (" << plan.splits
                          << " splits)";
}

TEST(Sm90SplitKv, PartialsCoverEveryRow) { check_partials("split_partials", 0); }
TEST(Sm90SplitKv, ForcedPartialsCoverEveryRow) { check_partials("split_partials_forced", 5); }

// The order lives in the caller's workspace: a varlen forward asks for it (and fixed-length ones
// for none), and without it is refused with nothing written.
TEST(Sm90TileOrder, VarlenForwardNeedsItsWorkspace) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Kernel k = kKernel;
  if (!kernel_built()) GTEST_SKIP() << "the 128:bf16 forward kernel is not built";
  Case fixed = base_case(k, {"", 2, 300, 300});
  fixed.name = "tile_order_fixed";
  std::mt19937_64 fixed_rng = make_rng(fixed.name);
  size_t bytes = 1;
  ASSERT_TRUE(workspace_size(make_setup(fixed, fixed_rng)->problem, Backend::kSm90,
                             Pass::kForward, &bytes).ok());
  EXPECT_EQ(bytes, 0u);

  Case c = base_case(k, {"", 0, 0, 0});
  c.lens_q = {300, 0, 17};
  c.lens_k = {300, 40, 17};
  c.name = "tile_order_refused";
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  DeviceRun run(*setup);
  run.overrides = Overrides{};  // the library's own choices: the order's workspace
  ASSERT_CUDA(run.upload());
  ASSERT_GT(run.workspace.bytes(), 0u);
  struct Attempt {
    const char* what;
    Workspace workspace;
    StatusCode code;
  } attempts[] = {
      {"no workspace", {}, StatusCode::kWorkspaceTooSmall},
      {"one byte short", {run.workspace.view().data, run.workspace.bytes() - 1},
       StatusCode::kWorkspaceTooSmall},
      {"misaligned", {static_cast<char*>(run.workspace.view().data) + 4, run.workspace.bytes()},
       StatusCode::kInvalidArgument},
  };
  for (const Attempt& a : attempts) {
    SCOPED_TRACE(a.what);
    expect_refused(run, run.problem, a.workspace, a.code, "workspace");
  }
}

}  // namespace
}  // namespace fa4::test
