// The launch plans of the benchmark's rows on an H200 (132 SMs, 50 MB of L2): the choices its
// committed results were measured with (bench/results/, docs/benchmarks.md). A plan change that
// moves one of them is a performance change: measure it beside cuDNN, then update this table.
#include <gtest/gtest.h>

#include <cstdint>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "sm90/host/bwd_plan.hpp"
#include "sm90/host/fwd_plan.hpp"

namespace {

using namespace fa4;
using namespace fa4::sm90;

const DeviceFacts kH200{132, 50 << 20};

struct FwdRow {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  struct {
    int variant, pack_group, splits, persistent, ctas, group;  // variant: FwdVariant
  } plan;
};

// The forward sweep (16k tokens, hidden 2048), its GQA 64/8 rows, and bench/gqa_short.py's decode
// and short-query rows.
const FwdRow kFwdRows[] = {
    {32, 512, 512, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {32, 512, 512, 32, 32, 64, true, {0, 1, 1, 1, 132, 128}},
    {16, 1024, 1024, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 32, 32, 64, true, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 32, 32, 64, true, {0, 1, 1, 1, 132, 16}},
    {4, 4096, 4096, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 32, 32, 64, true, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 32, 32, 64, true, {0, 1, 1, 0, 2752, 8}},
    {1, 16384, 16384, 32, 32, 64, false, {0, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 32, 32, 64, true, {0, 1, 1, 0, 2752, 4}},
    {32, 512, 512, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {32, 512, 512, 21, 21, 96, true, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 21, 21, 96, true, {0, 1, 1, 1, 132, 42}},
    {8, 2048, 2048, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 21, 21, 96, true, {0, 1, 1, 1, 132, 21}},
    {4, 4096, 4096, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 21, 21, 96, true, {0, 1, 1, 1, 132, 6}},
    {2, 8192, 8192, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 21, 21, 96, true, {0, 1, 1, 0, 2688, 7}},
    {1, 16384, 16384, 21, 21, 96, false, {0, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 21, 21, 96, true, {0, 1, 1, 0, 2688, 3}},
    {32, 512, 512, 16, 16, 128, false, {0, 1, 1, 1, 132, 1}},
    {32, 512, 512, 16, 16, 128, true, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 16, 16, 128, false, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 16, 16, 128, true, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 16, 16, 128, false, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 16, 16, 128, true, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 16, 16, 128, false, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 16, 16, 128, true, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 16, 16, 128, false, {4, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 16, 16, 128, true, {0, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 16, 16, 128, false, {4, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 16, 16, 128, true, {0, 1, 1, 0, 2048, 2}},
    {32, 512, 512, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {32, 512, 512, 10, 10, 192, true, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 10, 10, 192, true, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 10, 10, 192, true, {0, 1, 1, 0, 1280, 16}},
    {4, 4096, 4096, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 10, 10, 192, true, {0, 1, 1, 0, 1280, 8}},
    {2, 8192, 8192, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 10, 10, 192, true, {0, 1, 1, 0, 1280, 4}},
    {1, 16384, 16384, 10, 10, 192, false, {0, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 10, 10, 192, true, {0, 1, 1, 0, 1280, 2}},
    {32, 512, 512, 8, 8, 256, false, {0, 1, 1, 1, 132, 1}},
    {32, 512, 512, 8, 8, 256, true, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 8, 8, 256, false, {0, 1, 1, 1, 132, 1}},
    {16, 1024, 1024, 8, 8, 256, true, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 8, 8, 256, false, {0, 1, 1, 1, 132, 1}},
    {8, 2048, 2048, 8, 8, 256, true, {0, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 8, 8, 256, false, {1, 1, 1, 1, 132, 1}},
    {4, 4096, 4096, 8, 8, 256, true, {0, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 8, 8, 256, false, {1, 1, 1, 1, 132, 1}},
    {2, 8192, 8192, 8, 8, 256, true, {0, 1, 1, 0, 1024, 2}},
    {1, 16384, 16384, 8, 8, 256, false, {1, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 8, 8, 256, true, {0, 1, 1, 0, 1024, 1}},
    {1, 2048, 2048, 64, 8, 128, false, {0, 1, 1, 1, 132, 1}},
    {1, 2048, 2048, 64, 8, 128, true, {0, 1, 1, 1, 132, 1}},
    {1, 4096, 4096, 64, 8, 128, false, {0, 1, 1, 1, 132, 1}},
    {1, 4096, 4096, 64, 8, 128, true, {0, 1, 1, 1, 132, 1}},
    {1, 8192, 8192, 64, 8, 128, false, {4, 1, 1, 1, 132, 1}},
    {1, 8192, 8192, 64, 8, 128, true, {0, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 64, 8, 128, false, {4, 1, 1, 1, 132, 1}},
    {1, 16384, 16384, 64, 8, 128, true, {0, 1, 1, 1, 132, 1}},
    {64, 1, 4096, 32, 8, 128, false, {0, 4, 1, 1, 132, 1}},
    {8, 1, 32768, 32, 8, 128, false, {2, 4, 2, 0, 128, 1}},
    {1, 1, 262144, 32, 8, 128, false, {2, 4, 16, 0, 128, 1}},
    {4, 1, 65536, 32, 8, 128, false, {2, 4, 4, 0, 128, 1}},
    {8, 4, 8192, 32, 8, 128, false, {2, 4, 2, 0, 128, 1}},
    {8, 64, 8192, 32, 8, 128, false, {4, 4, 1, 0, 128, 1}},
    {2, 1, 131072, 32, 8, 256, false, {1, 4, 8, 0, 128, 1}},
};

TEST(Sm90BenchmarkPlans, Forward) {
  for (const FwdRow& r : kFwdRows) {
    Problem p;
    p.batch = r.batch;
    p.seqlen_q = r.seqlen_q;
    p.seqlen_k = r.seqlen_k;
    p.heads_q = r.heads_q;
    p.heads_kv = r.heads_kv;
    p.head_dim_qk = p.head_dim_v = r.head_dim;
    p.causal = r.causal;
    SCOPED_TRACE(testing::Message() << "b " << r.batch << " sq " << r.seqlen_q << " sk "
                                    << r.seqlen_k << " h " << r.heads_q << "/" << r.heads_kv
                                    << " d " << r.head_dim << (r.causal ? " causal" : ""));
    const FwdPlan plan = plan_forward(p, kH200, {});
    EXPECT_EQ(int(plan.variant), r.plan.variant);
    EXPECT_EQ(plan.pack_group, r.plan.pack_group);
    EXPECT_EQ(plan.splits, r.plan.splits);
    EXPECT_EQ(int(plan.ctas < plan.entries), r.plan.persistent);
    EXPECT_EQ(plan.ctas, r.plan.ctas);
    EXPECT_EQ(plan.group, r.plan.group);
  }
}

struct BwdRow {
  int64_t batch, seqlen, heads, head_dim;
  bool causal;
  struct {
    int pairs, group, rotate;
  } plan;
};

const BwdRow kBwdRows[] = {
    {32, 512, 32, 64, false, {0, 1, 1}},
    {32, 512, 32, 64, true, {0, 66, 0}},
    {8, 2048, 32, 64, false, {0, 1, 1}},
    {8, 2048, 32, 64, true, {0, 17, 0}},
    {2, 8192, 32, 64, false, {0, 1, 1}},
    {2, 8192, 32, 64, true, {0, 5, 0}},
    {1, 16384, 32, 64, false, {0, 1, 1}},
    {1, 16384, 32, 64, true, {0, 3, 0}},
    {32, 512, 21, 96, false, {0, 1, 1}},
    {32, 512, 21, 96, true, {0, 65, 0}},
    {8, 2048, 21, 96, false, {0, 1, 1}},
    {8, 2048, 21, 96, true, {0, 16, 0}},
    {2, 8192, 21, 96, false, {0, 1, 1}},
    {2, 8192, 21, 96, true, {0, 4, 0}},
    {1, 16384, 21, 96, false, {0, 1, 1}},
    {1, 16384, 21, 96, true, {0, 2, 0}},
    {32, 512, 16, 128, false, {0, 1, 1}},
    {32, 512, 16, 128, true, {0, 49, 0}},
    {8, 2048, 16, 128, false, {0, 1, 1}},
    {8, 2048, 16, 128, true, {0, 12, 0}},
    {2, 8192, 16, 128, false, {0, 1, 1}},
    {2, 8192, 16, 128, true, {0, 3, 0}},
    {1, 16384, 16, 128, false, {0, 1, 1}},
    {1, 16384, 16, 128, true, {0, 1, 0}},
    {32, 512, 10, 192, false, {0, 1, 1}},
    {32, 512, 10, 192, true, {0, 33, 0}},
    {8, 2048, 10, 192, false, {0, 1, 1}},
    {8, 2048, 10, 192, true, {0, 8, 0}},
    {2, 8192, 10, 192, false, {0, 1, 1}},
    {2, 8192, 10, 192, true, {0, 2, 0}},
    {1, 16384, 10, 192, false, {0, 1, 1}},
    {1, 16384, 10, 192, true, {0, 1, 0}},
    {32, 512, 8, 256, false, {1, 1, 1}},
    {32, 512, 8, 256, true, {1, 24, 0}},
    {8, 2048, 8, 256, false, {1, 1, 1}},
    {8, 2048, 8, 256, true, {1, 6, 0}},
    {2, 8192, 8, 256, false, {1, 1, 1}},
    {2, 8192, 8, 256, true, {1, 1, 0}},
    {1, 16384, 8, 256, false, {1, 1, 1}},
    {1, 16384, 8, 256, true, {1, 1, 0}},
};

TEST(Sm90BenchmarkPlans, Backward) {
  for (const BwdRow& r : kBwdRows) {
    Problem p;
    p.batch = r.batch;
    p.seqlen_q = p.seqlen_k = r.seqlen;
    p.heads_q = p.heads_kv = r.heads;
    p.head_dim_qk = p.head_dim_v = r.head_dim;
    p.causal = r.causal;
    SCOPED_TRACE(testing::Message() << "b " << r.batch << " s " << r.seqlen << " h " << r.heads
                                    << " d " << r.head_dim << (r.causal ? " causal" : ""));
    const BwdPlan plan = plan_backward(p, kH200, {});
    EXPECT_EQ(int(plan.pairs), r.plan.pairs);
    EXPECT_EQ(plan.group, r.plan.group);
    EXPECT_EQ(int(plan.rotate), r.plan.rotate);
  }
}

}  // namespace
