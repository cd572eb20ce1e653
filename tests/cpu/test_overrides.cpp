// Overrides (include/fa4/overrides.hpp): the environment reader, the one place the library reads
// the environment; validation at the entry points; and the public workspace_size, which depends
// on the overrides passed and never on the environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"

namespace {

using namespace fa4;

// Sets one variable for the scope of a test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

Overrides read_env() {
  Overrides o;
  const Status s = overrides_from_env(&o);
  EXPECT_TRUE(s.ok()) << s.message;
  return o;
}

TEST(Overrides, UnsetOrEmptyVariablesLeaveTheLibrarysChoice) {
  ScopedEnv empty("FA4_SM90_SCHEDULE", "");
  const Overrides o = read_env();
  EXPECT_EQ(o.persistent, Choice::kAuto);
  EXPECT_EQ(o.pack_gqa, Choice::kAuto);
  EXPECT_EQ(o.longest_first, Choice::kAuto);
  EXPECT_EQ(o.chunked_kv, Choice::kAuto);
  EXPECT_EQ(o.bwd_rotate, Choice::kAuto);
  EXPECT_EQ(o.bwd_pairs, Choice::kAuto);
  EXPECT_EQ(o.persistent_ctas + o.zigzag_group + o.splits + o.bwd_group + o.cpu_threads, 0);
}

TEST(Overrides, EveryChoiceVariable) {
  struct Case {
    const char* name;
    const char* on;
    const char* off;
    Choice Overrides::*member;
  } cases[] = {{"FA4_SM90_SCHEDULE", "persistent", "per_tile", &Overrides::persistent},
               {"FA4_SM90_PACK_GQA", "1", "0", &Overrides::pack_gqa},
               {"FA4_SM90_TILE_ORDER", "longest", "input", &Overrides::longest_first},
               {"FA4_SM90_CHUNKED_KV", "on", "off", &Overrides::chunked_kv},
               {"FA4_SM90_NARROW", "on", "off", &Overrides::narrow},
               {"FA4_SM90_UNMASKED", "on", "off", &Overrides::unmasked},
               {"FA4_SM90_BWD_ROTATE", "on", "off", &Overrides::bwd_rotate},
               {"FA4_SM90_BWD_PAIRS", "on", "off", &Overrides::bwd_pairs}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    {
      ScopedEnv on(c.name, c.on);
      EXPECT_EQ(read_env().*c.member, Choice::kOn);
    }
    {
      ScopedEnv off(c.name, c.off);
      EXPECT_EQ(read_env().*c.member, Choice::kOff);
    }
    ScopedEnv bad(c.name, "maybe");
    Overrides o;
    o.splits = 7;
    const Status s = overrides_from_env(&o);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
    EXPECT_NE(s.message.find(c.name), std::string::npos) << s.message;
    EXPECT_EQ(o.splits, 7) << "left unchanged";
  }
}

TEST(Overrides, EveryCountVariable) {
  struct Case {
    const char* name;
    int Overrides::*member;
  } cases[] = {{"FA4_SM90_PERSISTENT_CTAS", &Overrides::persistent_ctas},
               {"FA4_SM90_ZIGZAG_GROUP", &Overrides::zigzag_group},
               {"FA4_SM90_SPLITS", &Overrides::splits},
               {"FA4_SM90_BWD_GROUP", &Overrides::bwd_group},
               {"FA4_CPU_THREADS", &Overrides::cpu_threads}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    {
      ScopedEnv three(c.name, "3");
      EXPECT_EQ(read_env().*c.member, 3);
    }
    {
      ScopedEnv largest(c.name, "2147483647");
      EXPECT_EQ(read_env().*c.member, 2147483647);
    }
    for (const char* bad : {"-1", "3x", "many", "99999999999", "2147483648"}) {
      ScopedEnv e(c.name, bad);
      Overrides o;
      const Status s = overrides_from_env(&o);
      EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(s.message.find(c.name), std::string::npos) << s.message;
    }
  }
}

Problem small_problem() {
  Problem p;
  p.batch = 2;
  p.seqlen_q = p.seqlen_k = 300;
  p.heads_q = p.heads_kv = 8;
  p.head_dim_qk = p.head_dim_v = 128;
  return p;
}

TEST(Overrides, EntryPointsRefuseInvalidOverrides) {
  size_t bytes = 77;
  Overrides o;
  o.bwd_group = -2;
  Status s = workspace_size(small_problem(), Backend::kCpu, Pass::kForward, o, &bytes);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("bwd_group"), std::string::npos) << s.message;
  EXPECT_EQ(bytes, 77u);
  for (int bad : {5, -2, 255}) {
    o = Overrides{};
    o.chunked_kv = Choice(bad);
    s = workspace_size(small_problem(), Backend::kCpu, Pass::kForward, o, &bytes);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message.find("chunked_kv"), std::string::npos) << s.message;
  }
}

#if defined(FA4_WITH_CUDA)
// The sm90 forward's workspace: the same whatever the environment says, and what the overrides
// passed ask for (3 forced splits need partials, where 300 keys never split by themselves). On the
// first head dim this build has a kernel for (workspace_size needs no GPU).
TEST(Overrides, WorkspaceSizeFollowsTheOverridesNotTheEnvironment) {
  Problem p = small_problem();
  bool built = false;
  for (int64_t dim : {128, 64, 96, 192, 256}) {
    p.head_dim_qk = p.head_dim_v = dim;
    size_t bytes = 0;
    if ((built = workspace_size(p, Backend::kSm90, Pass::kForward, &bytes).ok())) break;
  }
  if (!built) GTEST_SKIP() << "this build has no sm90 forward kernel of these head dims";
  size_t plain = 1;
  ASSERT_TRUE(workspace_size(p, Backend::kSm90, Pass::kForward, &plain).ok());
  EXPECT_EQ(plain, 0u);
  {
    ScopedEnv forced("FA4_SM90_SPLITS", "3");
    size_t bytes = 1;
    ASSERT_TRUE(workspace_size(p, Backend::kSm90, Pass::kForward, &bytes).ok());
    EXPECT_EQ(bytes, 0u) << "the environment changes nothing";
  }
  Overrides o;
  o.splits = 3;
  size_t split = 0;
  ASSERT_TRUE(workspace_size(p, Backend::kSm90, Pass::kForward, o, &split).ok());
  // 3 splits · 8 heads · 600 rows · (head dim + 1) floats.
  EXPECT_EQ(split, size_t(3 * 8 * 600 * (p.head_dim_v + 1) * 4 + 255) / 256 * 256);
}
#endif

}  // namespace
