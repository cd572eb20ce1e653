// The sm90 backward kernel against the double reference's gradients (docs/testing.md's rule, as
// tests/cpu/test_backward.cpp applies it), on the out / LSE the sm90 forward produced, as a user
// would run the two: fixed-length (sq, sk) pairs from 1 to 512 both ways with no mask, causal, a
// sliding window and softcap, GQA 1 / 4 (MQA once); varlen batches with empty sequences on either
// side; seqused_k; q, k, v and dq, dk, dv as slices of packed qkv / dqkv tensors; one long causal
// sequence; the deterministic mode. Every case runs three times (workspace poisoned, workspace
// reused, CUDA-graph replay): by default dQ (and GQA's dK / dV) are summed in the order the CTAs
// get there, so runs may differ in the last bits, but each must pass the rule (an error that moves
// between runs is a race); in deterministic mode the three runs must agree bit for bit. Gradients are poisoned before every run: every element must
// be written, varlen rows outside every sequence must not be, and neither may anything around the
// tensors nor any input. Problems the backward does not implement must be refused with nothing
// written.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <future>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"
#include "device_buffer.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

struct Heads {
  int64_t q, kv;
};
constexpr Heads kMha = {4, 4};
constexpr Heads kGqa4 = {8, 2};
constexpr Heads kMqa = {8, 1};
// GQA 4 with a single kv head: half the reference work of kGqa4 for the long varlen batch.
constexpr Heads kGqa4Single = {4, 1};

void set_heads(Case& c, Heads h) {
  c.heads_q = h.q;
  c.heads_kv = h.kv;
}

enum class Mask { kNone, kCausal, kWindow, kSoftcap };
constexpr Mask kMasks[] = {Mask::kNone, Mask::kCausal, Mask::kWindow, Mask::kSoftcap};
// A band narrower than a tile on both sides of the diagonal, so that tiles are cut left and right.
constexpr Window kBand = {37, 11};
constexpr float kSoftcap = 30.0f;

// Sets the mask on `c`; returns its part of the case name.
std::string apply_mask(Case& c, Mask m) {
  switch (m) {
    case Mask::kNone: return "";
    case Mask::kCausal: c.causal = true; return "_causal";
    case Mask::kWindow: c.window = kBand; return "_window" + window_tag(kBand);
    case Mask::kSoftcap: c.softcap = kSoftcap; return "_softcap" + std::to_string(int(kSoftcap));
  }
  return "";
}

// kernel_shape_gqaN_mask[_packed][_headmajor][_spiky], e.g. d128_bf16_q113_k203_gqa4_causal.
std::string case_name(const Kernel& k, const std::string& shape, const Case& c,
                      const std::string& mask) {
  return kernel_tag(k) + "_" + shape + gqa_tag(c) + mask + (c.packed_qkv ? "_packed" : "") +
         (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "");
}

// ---- Fixed-length cases: a query tile of one row, queries without keys (causal sq > sk), keys
// no query sees (window, causal sq < sk), tile edges (128 queries), several query tiles per key
// tile and the reverse.

const Shape kFixedShapes[] = {
    {"q1_k1", 2, 1, 1},         {"q1_k300", 2, 1, 300},     {"q113_k203", 2, 113, 203},
    {"q128_k217", 1, 128, 217}, {"q512_k256", 1, 512, 256}, {"q300_k1", 2, 300, 1},
};

Case fixed_case(const Kernel& k, const Shape& s, Mask m, Heads h, bool spiky, bool head_major) {
  Case c = base_case(k, s);
  set_heads(c, h);
  c.spiky = spiky;
  if (head_major) c.layout = Layout::kHeadMajor;
  const std::string mask = apply_mask(c, m);
  c.name = case_name(k, s.tag, c, mask);
  return c;
}

// The full kernel: every shape × mask × GQA {1, 4}, inputs and layouts rotating; plus MQA, a
// custom scale and a strong softcap.
std::vector<Case> full_fixed_cases(const Kernel& k) {
  std::vector<Case> cases;
  int r = 0;
  for (size_t si = 0; si < std::size(kFixedShapes); ++si)
    for (size_t mi = 0; mi < std::size(kMasks); ++mi)
      for (size_t gi = 0; gi < 2; ++gi, ++r) {
        const bool spiky = (si + mi + gi) % 2 == 1;
        cases.push_back(fixed_case(k, kFixedShapes[si], kMasks[mi], gi == 0 ? kMha : kGqa4, spiky,
                                   r % 3 == 2));
      }
  cases.push_back(fixed_case(k, kFixedShapes[2], Mask::kCausal, kMqa, true, false));

  Case scaled = fixed_case(k, kFixedShapes[2], Mask::kCausal, kGqa4, false, false);
  scaled.scale = 0.5f;
  scaled.name += "_scale0_5";
  cases.push_back(scaled);

  // A cap the spiky scores reach: tanh saturates, its derivative 1 − t² nears 0.
  Case capped = fixed_case(k, kFixedShapes[3], Mask::kNone, kGqa4, true, false);
  capped.softcap = 5.0f;
  capped.name = case_name(k, kFixedShapes[3].tag, capped, "_softcap5");
  cases.push_back(capped);
  return cases;
}

// The other kernels share everything but the tile sizes: every mask on one shape, the shapes'
// extremes once each.
std::vector<Case> other_fixed_cases(const Kernel& k) {
  std::vector<Case> cases;
  for (size_t mi = 0; mi < std::size(kMasks); ++mi)
    cases.push_back(fixed_case(k, kFixedShapes[2], kMasks[mi], mi % 2 ? kGqa4 : kMha, mi >= 2,
                               false));
  cases.push_back(fixed_case(k, kFixedShapes[0], Mask::kSoftcap, kMha, false, false));
  cases.push_back(fixed_case(k, kFixedShapes[1], Mask::kNone, kMha, true, false));
  cases.push_back(fixed_case(k, kFixedShapes[3], Mask::kNone, kGqa4, false, true));
  cases.push_back(fixed_case(k, kFixedShapes[4], Mask::kCausal, kGqa4, true, false));
  cases.push_back(fixed_case(k, kFixedShapes[5], Mask::kCausal, kGqa4, false, false));
  return cases;
}

// ---- Varlen batches: empty query and key sequences, one-row sequences, sequences longer than a
// tile; each mask aligned to each sequence's own bottom-right corner.

struct VarlenSet {
  const char* tag;
  std::vector<int32_t> lens_q, lens_k;
};
// Queries of a sequence without keys get dQ = 0; keys of a sequence without queries, dK = dV = 0.
const VarlenSet kOdd = {"odd", {177, 0, 479}, {257, 1, 766}};
const VarlenSet kShort = {"short", {1, 64, 65}, {128, 0, 200}};
const VarlenSet kEmpty = {"empty", {0, 0, 0}, {0, 0, 0}};

Case varlen_case(const Kernel& k, const VarlenSet& set, Mask m, Heads h, bool spiky,
                 bool head_major) {
  Case c = base_case(k, {"", 0, 0, 0});
  c.lens_q = set.lens_q;
  c.lens_k = set.lens_k;
  set_heads(c, h);
  c.spiky = spiky;
  if (head_major) c.layout = Layout::kHeadMajor;
  const std::string mask = apply_mask(c, m);
  c.name = case_name(k, std::string("varlen_") + set.tag, c, mask);
  return c;
}

std::vector<Case> varlen_cases(const Kernel& k) {
  std::vector<Case> cases;
  if (is_full_kernel(k)) {
    cases.push_back(varlen_case(k, kOdd, Mask::kNone, kGqa4Single, false, false));
    cases.push_back(varlen_case(k, kOdd, Mask::kCausal, kGqa4Single, true, true));
    for (size_t mi = 0; mi < std::size(kMasks); ++mi)
      cases.push_back(varlen_case(k, kShort, kMasks[mi], kGqa4, mi % 2 == 0, mi == 3));
  } else {
    cases.push_back(varlen_case(k, kOdd, Mask::kCausal, kGqa4Single, true, false));
    cases.push_back(varlen_case(k, kShort, Mask::kSoftcap, kGqa4, false, true));
  }
  // Without GQA dK and dV go straight to the outputs (the wide kernel's through shared memory):
  // rows of partial key tiles, a one-key sequence and an empty query sequence there.
  cases.push_back(varlen_case(k, kOdd, Mask::kCausal, kMha, false, false));
  // Every sequence empty: the call must succeed and write nothing (the tensors have only the
  // spare rows past the last sequence).
  cases.push_back(varlen_case(k, kEmpty, Mask::kCausal, kGqa4, false, false));
  return cases;
}

// ---- seqused_k: sequence b uses only its first seqused_k[b] keys (0, 1, all, and in between; a
// partial key tile, and key tiles past it that see no query); the key rows past it hold NaN in K
// and V and must get dK = dV = 0. Fixed-length and varlen, with the masks it moves.

std::vector<Case> seqused_cases(const Kernel& k) {
  std::vector<Case> cases;
  const Shape fixed = {"q200_k300", 5, 200, 300};
  const std::vector<int32_t> fixed_used = {0, 1, 300, 150, 129};
  const Mask fixed_masks[] = {Mask::kNone, Mask::kCausal, Mask::kWindow};
  for (size_t mi = 0; mi < std::size(fixed_masks); ++mi) {
    if (!is_full_kernel(k) && mi != 1) continue;
    Case c = fixed_case(k, fixed, fixed_masks[mi], mi == 1 ? kGqa4 : kMha, mi == 0, false);
    c.seqused_k = fixed_used;
    c.name += "_used";
    cases.push_back(c);
  }
  const VarlenSet used_set = {"used", {150, 64, 1, 257, 100, 0, 129},
                              {300, 64, 500, 256, 0, 10, 128}};
  for (Mask m : {Mask::kNone, Mask::kCausal}) {
    if (!is_full_kernel(k) && m == Mask::kNone) continue;
    Case c = varlen_case(k, used_set, m, kGqa4, m == Mask::kCausal, false);
    c.seqused_k = {0, 64, 1, 129, 0, 10, 127};
    cases.push_back(c);
  }
  return cases;
}

// ---- Non-contiguous: q, k, v slices of one packed qkv tensor, and the gradients slices of one
// packed dqkv tensor (make_setup packs when the query and key rows pair up).

std::vector<Case> packed_cases(const Kernel& k) {
  std::vector<Case> cases;
  Case c = fixed_case(k, {"q257_k257", is_full_kernel(k) ? 2 : 1, 257, 257}, Mask::kCausal, kGqa4,
                      true, false);
  c.packed_qkv = true;
  c.name = case_name(k, "q257_k257", c, "_causal");
  cases.push_back(c);
  if (!is_full_kernel(k)) return cases;

  c = fixed_case(k, {"q200_k200", 1, 200, 200}, Mask::kSoftcap, kMha, false, false);
  c.packed_qkv = true;
  c.name = case_name(k, "q200_k200", c, "_softcap30");
  cases.push_back(c);

  const VarlenSet self = {"self", {177, 0, 64, 1, 300}, {177, 0, 64, 1, 300}};
  c = varlen_case(k, self, Mask::kCausal, kGqa4, true, false);
  c.packed_qkv = true;
  c.name = case_name(k, "varlen_self", c, "_causal");
  cases.push_back(c);
  return cases;
}

// Deterministic mode: dQ added in key-tile order (several key tiles per query tile: sk = 600),
// GQA dK / dV in query-head order, a band whose left side moves the first key tile of each query
// tile (the turn count starts there), varlen.
std::vector<Case> deterministic_cases(const Kernel& k) {
  std::vector<Case> cases;
  auto add = [&](Case c, const char* suffix) {
    c.deterministic = true;
    c.name += suffix;
    cases.push_back(c);
  };
  const Shape long_keys = {"q300_k600", 1, 300, 600};
  const Shape long_queries = {"q600_k300", 1, 600, 300};
  for (Mask m : {Mask::kNone, Mask::kCausal, Mask::kWindow})
    add(fixed_case(k, long_keys, m, kGqa4, false, false), "_deterministic");
  // More queries than keys: the band's left side moves each query tile's first key tile.
  add(fixed_case(k, long_queries, Mask::kWindow, kGqa4, false, false), "_deterministic");
  for (Mask m : {Mask::kCausal, Mask::kWindow})
    add(varlen_case(k, kOdd, m, kGqa4, false, false), "_deterministic");
  // seqused_k: key tiles past it add zeros to the GQA accumulators in turn too.
  Case u = fixed_case(k, {"q200_k300", 3, 200, 300}, Mask::kCausal, kGqa4, false, false);
  u.seqused_k = {129, 0, 300};
  add(u, "_used_deterministic");
  // Without GQA (dK / dV stored directly), causal with query tiles that see no key.
  add(fixed_case(k, long_queries, Mask::kCausal, kMha, true, false), "_deterministic");
  // Varlen with seqused_k.
  Case vu = varlen_case(k, {"used", {150, 64, 1, 257, 100, 0, 129}, {300, 64, 500, 256, 0, 10, 128}},
                        Mask::kCausal, kGqa4, false, false);
  vu.seqused_k = {0, 64, 1, 129, 0, 10, 127};
  add(vu, "_deterministic");
  return cases;
}

// d256's key-tile pairs (bwd_pair.cuh: fixed lengths, an even number of 64-key tiles; gpu_check.sh
// runs the d256 tests with them off too): a pair whose key tiles both see no query, and one whose
// first sees none (a window at the end of the keys); and walks long enough for both dS stages to
// turn over many times, with and without a band.
std::vector<Case> pair_cases(const Kernel& k) {
  std::vector<Case> cases;
  if (k.dim_qk != 256) return cases;
  cases.push_back(fixed_case(k, {"q1_k256", 2, 1, 256}, Mask::kWindow, kGqa4, true, false));
  cases.push_back(fixed_case(k, {"q1000_k1024", 1, 1000, 1024}, Mask::kCausal, kGqa4, true, false));
  cases.push_back(fixed_case(k, {"q1000_k1024", 1, 1000, 1024}, Mask::kNone, kGqa4, false, true));
  return cases;
}

std::vector<Case> backward_cases() {
  std::vector<Case> cases;
  auto append = [&](const std::vector<Case>& more) {
    cases.insert(cases.end(), more.begin(), more.end());
  };
  for (const Kernel& k : built_backward_kernels()) {
    append(is_full_kernel(k) ? full_fixed_cases(k) : other_fixed_cases(k));
    // Without a band d256's key tiles start at their own query tiles (QueryOrder): 5 query
    // tiles, the last partial, so that the walks wrap and the steps' parities cross the wrap
    // (gpu_check.sh also runs it with FA4_SM90_BWD_ROTATE=off).
    cases.push_back(fixed_case(k, {"q300_k600", 1, 300, 600}, Mask::kNone, kGqa4, true, false));
    append(varlen_cases(k));
    append(packed_cases(k));
    append(seqused_cases(k));
    append(deterministic_cases(k));
    append(pair_cases(k));
    // The score variants over a share of the kernel's fixed-length cases and its varlen ones
    // (empty sequences included): sinks with their gradient, ALiBi per head, both with ALiBi per
    // (batch, head), in turn.
    std::vector<Case> from = is_full_kernel(k) ? full_fixed_cases(k) : other_fixed_cases(k);
    const std::vector<Case> varlen = varlen_cases(k);
    from.insert(from.end(), varlen.begin(), varlen.end());
    for (size_t n = 0; n < from.size(); n += 3) cases.push_back(with_variant(from[n], n / 3));
  }
  return cases;
}

// ---- Device state of one backward call.


const char* const kGradNames[] = {"dq", "dk", "dv"};

// A case's inputs on the device (q, k, v, sequence arrays and the forward's out / LSE through
// DeviceRun, dO beside them), its gradients (one allocation for a packed dqkv, else one each,
// guards around every one), and the workspace. `fwd->problem` points at the device arrays; the
// reference reads `setup` on the host.
struct BackwardRun {
  std::unique_ptr<CaseData> setup;
  std::unique_ptr<DeviceRun> fwd;
  HostTensor dout;
  std::vector<HostTensor> grads;  // dq, dk, dv
  std::unique_ptr<DeviceMirror> d_dout;
  std::vector<std::unique_ptr<DeviceMirror>> d_grads;
  std::vector<float> dsinks;  // with sinks: heads_q, NaN before each run
  std::unique_ptr<DeviceMirror> d_dsinks;
  DeviceWorkspace workspace;
  BackwardTensors tensors;

  explicit BackwardRun(const Case& c) {
    std::mt19937_64 rng = make_rng(c.name);
    setup = make_setup(c, rng);
    poison_unused_rows(*setup);
    const Problem& p = setup->problem;
    fwd = std::make_unique<DeviceRun>(*setup);
    dout = HostTensor(p.dtype, query_dims(p, p.heads_q, p.head_dim_v),
                      setup->layout == Layout::kHeadMajor ? Layout::kHeadMajor
                                                          : Layout::kContiguous);
    dout.fill_normal(rng);
    if (p.is_varlen()) {
      // Rows past the last sequence are no query's: NaN there shows if the kernel reads them.
      const int64_t end = setup->cu_q[size_t(p.batch)];
      dout.poison_rows(0, end, p.varlen.total_q - end);
    }
    const size_t elem = dtype_size(p.dtype);
    d_dout = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{mirror_view(dout)},
                                            elem);
    if (setup->packed) {
      const Dims qd = query_dims(p, p.heads_q, p.head_dim_qk);
      grads =
          HostTensor::packed_qkv(p.dtype, qd.batch, qd.seq, p.heads_q, p.heads_kv, p.head_dim_qk);
      d_grads.push_back(std::make_unique<DeviceMirror>(
          std::vector<DeviceMirror::View>{mirror_view(grads[0]), mirror_view(grads[1]),
                                          mirror_view(grads[2])},
          elem));
    } else {
      grads = {HostTensor(p.dtype, query_dims(p, p.heads_q, p.head_dim_qk), setup->layout),
               HostTensor(p.dtype, key_dims(p, p.heads_kv, p.head_dim_qk), setup->layout),
               HostTensor(p.dtype, key_dims(p, p.heads_kv, p.head_dim_v), setup->layout)};
      for (const HostTensor& g : grads)
        d_grads.push_back(std::make_unique<DeviceMirror>(
            std::vector<DeviceMirror::View>{mirror_view(g)}, elem));
    }
    const DeviceMirror& dq_mirror = *d_grads.front();
    const DeviceMirror& dk_mirror = *d_grads[setup->packed ? 0 : 1];
    const DeviceMirror& dv_mirror = *d_grads[setup->packed ? 0 : 2];
    tensors.q = fwd->tensors.q;
    tensors.k = fwd->tensors.k;
    tensors.v = fwd->tensors.v;
    tensors.out = fwd->tensors.out;
    tensors.lse = fwd->d_lse->device_view(fwd->lse.view());
    tensors.dout = d_dout->device_view(dout.view());
    tensors.dq = dq_mirror.device_view(grads[0].view());
    tensors.dk = dk_mirror.device_view(grads[1].view());
    tensors.dv = dv_mirror.device_view(grads[2].view());
    if (p.sinks != nullptr) {
      dsinks.assign(size_t(p.heads_q), std::numeric_limits<float>::quiet_NaN());
      d_dsinks = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{array_view(dsinks)},
                                                sizeof(float));
      tensors.dsinks = static_cast<float*>(d_dsinks->device(dsinks.data()));
    }
  }

  // q, k, v, the sequence arrays and dO (out and LSE come from the forward, or stay poisoned).
  std::string upload() {
    std::string e = d_dout->upload();
    if (e.empty()) e = fwd->d_out->upload();
    if (e.empty()) e = fwd->d_lse->upload();
    return e.empty() ? fwd->upload() : e;
  }

  // The gradients' views hold the pattern check_written recognises, the guards around them the
  // mirrors' own.
  std::string poison_gradients() {
    for (HostTensor& g : grads) g.poison();
    for (auto& m : d_grads) {
      std::string e = m->poison();
      if (e.empty()) e = m->upload();
      if (!e.empty()) return e;
    }
    if (d_dsinks) {
      std::fill(dsinks.begin(), dsinks.end(), std::numeric_limits<float>::quiet_NaN());
      std::string e = d_dsinks->poison();
      if (e.empty()) e = d_dsinks->upload();
      if (!e.empty()) return "dsinks: " + e;
    }
    return DeviceRun::device_sync();
  }

  std::string download_gradients() {
    for (auto& m : d_grads) {
      const std::string e = m->download(nullptr);
      if (!e.empty()) return e;
    }
    return d_dsinks ? d_dsinks->download(nullptr) : "";
  }

  // The device copies of every input, named, in DeviceRun's order of its inputs.
  std::vector<std::pair<std::string, DeviceMirror*>> input_mirrors() {
    std::vector<std::pair<std::string, DeviceMirror*>> named = {
        {"dout", d_dout.get()}, {"out", fwd->d_out.get()}, {"lse", fwd->d_lse.get()}};
    std::vector<std::string> names;
    if (setup->packed) {
      names = {"qkv"};
    } else {
      names = {"q", "k", "v"};
    }
    if (setup->problem.is_varlen()) names.insert(names.end(), {"cu_seqlens_q", "cu_seqlens_k"});
    if (setup->problem.seqused_k != nullptr) names.push_back("seqused_k");
    for (size_t n = 0; n < fwd->inputs.size(); ++n)
      named.emplace_back(n < names.size() ? names[n] : "input " + std::to_string(n),
                         fwd->inputs[n].get());
    return named;
  }

  // Every byte of every input, to tell whether the backward wrote into one.
  std::string snapshot_inputs(std::vector<std::vector<unsigned char>>* bytes) {
    bytes->clear();
    for (const auto& [name, mirror] : input_mirrors()) {
      bytes->emplace_back(mirror->bytes());
      const std::string e = mirror->download(bytes->back().data());
      if (!e.empty()) return name + ": " + e;
    }
    return "";
  }

  // Poisons the gradients, runs the backward on `stream` (directly, or captured in a CUDA graph
  // and replayed), waits, and downloads the gradients into `grads`.
  std::string run(cudaStream_t stream, bool graph, Workspace ws, Status* status) {
    std::string e = poison_gradients();
    if (!e.empty()) return e;
    if (graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      auto failed = [](const char* what, cudaError_t err) {
        return std::string(what) + " failed: " + cudaGetErrorString(err);
      };
      cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      if (err != cudaSuccess) return failed("cudaStreamBeginCapture", err);
      *status = backward(fwd->problem, tensors, ws, stream, Backend::kSm90, fwd->overrides);
      // A synchronous CUDA call inside backward() invalidates the capture: it shows here.
      err = cudaStreamEndCapture(stream, &g);
      if (err != cudaSuccess) return failed("cudaStreamEndCapture (after backward)", err);
      err = cudaGraphInstantiate(&exec, g, 0);
      if (err != cudaSuccess) {
        cudaGraphDestroy(g);
        return failed("cudaGraphInstantiate", err);
      }
      err = cudaGraphLaunch(exec, stream);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
      if (err != cudaSuccess) return failed("cudaGraphLaunch", err);
    } else {
      *status = backward(fwd->problem, tensors, ws, stream, Backend::kSm90, fwd->overrides);
    }
    const cudaError_t err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return std::string("kernel: ") + cudaGetErrorString(err);
    return download_gradients();
  }
};

// Every gradient element inside a sequence written (finite), every other one and every byte
// around the views untouched.
void expect_gradients_written(BackwardRun& run, const std::vector<unsigned char>& q_rows,
                              const std::vector<unsigned char>& k_rows) {
  for (const CheckResult& w : check_gradients_written(run.grads, q_rows, k_rows, run.setup->packed))
    EXPECT_TRUE(w.ok) << w.message;
  for (size_t m = 0; m < run.d_grads.size(); ++m) {
    bool intact = false;
    ASSERT_CUDA(run.d_grads[m]->guards_intact(&intact));
    EXPECT_TRUE(intact) << (run.setup->packed ? std::string("dqkv") : kGradNames[m])
                        << ": bytes around the tensor were written";
  }
}

void expect_inputs_unchanged(BackwardRun& run,
                             const std::vector<std::vector<unsigned char>>& before) {
  std::vector<std::vector<unsigned char>> after;
  ASSERT_CUDA(run.snapshot_inputs(&after));
  const auto named = run.input_mirrors();
  for (size_t n = 0; n < before.size(); ++n)
    EXPECT_TRUE(before[n] == after[n])
        << "the backward pass wrote into its input " << named[n].first;
}

// Runs the sm90 forward on the uploaded inputs: out and LSE as a user would hand them over.
void run_forward(BackwardRun& run, cudaStream_t stream) {
  const Problem& p = run.fwd->problem;
  ASSERT_TRUE(kernel_listed(built_kernels(), p.head_dim_qk, p.head_dim_v, p.dtype))
      << "this build has the backward kernel but not the forward one its inputs come from";
  const Status can = can_implement(p, Backend::kSm90, Pass::kForward);
  ASSERT_TRUE(can.ok()) << "forward: " << to_string(can.code) << ": " << can.message;
  Status status;
  ASSERT_CUDA(run.fwd->run(stream, /*graph=*/false, &status));
  ASSERT_TRUE(status.ok()) << "forward: " << to_string(status.code) << ": " << status.message;
  // A broken forward would be blamed on the backward below: stop here instead.
  const std::vector<unsigned char> rows = rows_in_sequences(run.setup->problem, false);
  const CheckResult out = check_written("forward out", run.fwd->out, rows);
  ASSERT_TRUE(out.ok) << out.message;
  const CheckResult lse = check_written("forward lse", run.fwd->lse, rows);
  ASSERT_TRUE(lse.ok) << lse.message;
  ASSERT_CUDA(DeviceRun::device_sync());
}

// Uploads the inputs, runs the forward and allocates the backward's workspace (not poisoned):
// what every backward test needs before its first call. Callers check HasFatalFailure().
void prepare_backward(BackwardRun& run, cudaStream_t stream) {
  ASSERT_CUDA(run.upload());
  run_forward(run, stream);
  if (::testing::Test::HasFatalFailure()) return;
  size_t bytes = 0;
  const Status sized = workspace_size(run.fwd->problem, Backend::kSm90, Pass::kBackward,
                                      run.fwd->overrides, &bytes);
  ASSERT_TRUE(sized.ok()) << to_string(sized.code) << ": " << sized.message;
  ASSERT_CUDA(run.workspace.allocate(bytes));
}

constexpr int kRuns = 3;
const char* const kRunNames[kRuns] = {"run 1 of 3 (workspace poisoned)",
                                      "run 2 of 3 (workspace as run 1 left it)",
                                      "run 3 of 3 (replayed from a CUDA graph)"};

// The forward and the backward of `c` run under `overrides`.
void check_backward(const Case& c, const Overrides& overrides = test_overrides()) {
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  BackwardRun run(c);
  run.fwd->overrides = overrides;
  const Problem& p = run.setup->problem;  // host arrays, for the reference and row flags
  const Problem& device_problem = run.fwd->problem;
  const Status can = can_implement(device_problem, Backend::kSm90, Pass::kBackward);
  ASSERT_TRUE(can.ok()) << "a built backward kernel was refused: " << to_string(can.code) << ": "
                        << can.message;
  Stream stream;
  prepare_backward(run, stream.get());
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<std::vector<unsigned char>> inputs_before;
  ASSERT_CUDA(run.snapshot_inputs(&inputs_before));

  const std::vector<unsigned char> q_rows = rows_in_sequences(p, false),
                                   k_rows = rows_in_sequences(p, true);
  std::vector<std::vector<double>> results[kRuns];  // per run: dq, dk, dv
  std::vector<std::vector<uint64_t>> bits[kRuns];    // the same, as stored
  std::vector<double> dsinks[kRuns];                 // with sinks
  for (int attempt = 0; attempt < kRuns; ++attempt) {
    SCOPED_TRACE(kRunNames[attempt]);
    if (attempt == 0) ASSERT_CUDA(run.workspace.poison());
    ASSERT_CUDA(DeviceRun::device_sync());
    Status status;
    ASSERT_CUDA(run.run(stream.get(), /*graph=*/attempt == 2, run.workspace.view(), &status));
    ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;
    expect_gradients_written(run, q_rows, k_rows);
    expect_inputs_unchanged(run, inputs_before);
    for (const HostTensor& g : run.grads) {
      results[attempt].push_back(g.dense());
      bits[attempt].emplace_back();
      for (int64_t e = 0; e < g.size(); ++e) bits[attempt].back().push_back(g.bits(e));
    }
    dsinks[attempt].assign(run.dsinks.begin(), run.dsinks.end());
  }

  // D = rowsum(dO ∘ O) from the O the backward was handed. The two references are independent:
  // the exact one (the larger) on a second thread.
  const TensorView q = run.setup->q.view(), k = run.setup->k.view(), v = run.setup->v.view();
  const TensorView dout = run.dout.view(), given_out = run.fwd->out.view();
  std::future<ref::BackwardResult> exact_later = std::async(std::launch::async, [&] {
    return ref::backward(p, q, k, v, dout, ref::Precision::kExact, &given_out);
  });
  const ref::BackwardResult lp =
      ref::backward(p, q, k, v, dout, ref::Precision::kLowPrecision, &given_out);
  const ref::BackwardResult exact = exact_later.get();

  const std::vector<double>* refs[] = {&exact.dq, &exact.dk, &exact.dv};
  const std::vector<double>* lps[] = {&lp.dq, &lp.dk, &lp.dv};
  const int64_t rows[] = {std::count(q_rows.begin(), q_rows.end(), 1) * p.heads_q,
                          std::count(k_rows.begin(), k_rows.end(), 1) * p.heads_kv,
                          std::count(k_rows.begin(), k_rows.end(), 1) * p.heads_kv};
  const int64_t widths[] = {p.head_dim_qk, p.head_dim_qk, p.head_dim_v};
  // Deterministic mode: the three runs (the last a graph replay) agree bit for bit (the rows
  // outside every sequence hold the same poison in each).
  if (c.deterministic)
    for (int attempt = 1; attempt < kRuns; ++attempt)
      for (size_t g = 0; g < 3; ++g)
        EXPECT_TRUE(bits[attempt][g] == bits[0][g])
            << kGradNames[g] << ": " << kRunNames[attempt] << " differs from run 1";
  const FlashRule rule = flash_rule(p, Pass::kBackward);
  for (int attempt = 0; attempt < kRuns; ++attempt) {
    for (int g = 0; g < 3; ++g) {
      const std::string name = std::string(kGradNames[g]) + ", " + kRunNames[attempt];
      const double magnitude = max_finite_abs(*refs[g]);
      const CheckResult f =
          check_flash_rule(name, tensor_shape(run.grads[size_t(g)].dims()),
                           results[attempt][size_t(g)], *refs[g], *lps[g], rule.multiplier,
                           rule.atol + alibi_slack(p, magnitude, exact.score_abs_max));
      EXPECT_TRUE(f.ok) << f.message;
      EXPECT_EQ(f.compared, rows[g] * widths[g]) << name << ": reference rows missing";
    }
    // d(sinks): summed in a fixed order, so the same bits on every run, in any mode.
    if (p.sinks != nullptr) {
      const DenseShape shape{{"h"}, {p.heads_q}};
      const CheckResult f =
          check_flash_rule(std::string("dsinks, ") + kRunNames[attempt], shape, dsinks[attempt],
                           exact.dsinks, lp.dsinks, rule.multiplier, rule.atol);
      EXPECT_TRUE(f.ok) << f.message;
      EXPECT_EQ(f.compared, p.heads_q);
      EXPECT_TRUE(dsinks[attempt] == dsinks[0]) << "dsinks: " << kRunNames[attempt]
                                               << " differs from run 1";
    }
  }
}

class Sm90Backward : public ::testing::TestWithParam<Case> {};

TEST_P(Sm90Backward, MatchesReferenceGradients) { check_backward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, Sm90Backward, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });
// A build without backward kernels has no matrix; the tests below still check the refusals.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Sm90Backward);

// Each backward plan choice forced through Overrides on a few cases (scripts/gpu_check.sh reruns
// the d256 matrix under the first two through the FA4_SM90_* variables).
struct BwdPlanPath {
  const char* name;
  Overrides overrides;
};
// GoogleTest prints a parameter by its name, not its bytes.
void PrintTo(const BwdPlanPath& path, std::ostream* os) { *os << path.name; }

std::vector<BwdPlanPath> bwd_plan_paths() {
  std::vector<BwdPlanPath> paths(4);
  paths[0].name = "single_key_tiles";
  paths[0].overrides.bwd_pairs = Choice::kOff;
  paths[1].name = "plain_walk";
  paths[1].overrides.bwd_rotate = Choice::kOff;
  paths[2].name = "groups_of_3";
  paths[2].overrides.bwd_group = 3;
  paths[3].name = "groups_of_1";
  paths[3].overrides.bwd_group = 1;
  return paths;
}

class Sm90BackwardPlanPath : public ::testing::TestWithParam<BwdPlanPath> {};

// Cases with and without a band, GQA, every head dim built: the pairs and the rotated walk at
// d256, the groups under a causal mask everywhere.
TEST_P(Sm90BackwardPlanPath, MatchesReferenceGradients) {
  int checked = 0;
  for (const Case& c : backward_cases()) {
    if (c.name.find("_q300_k600_gqa4") == std::string::npos &&
        c.name.find("_q113_k203_gqa4_causal") == std::string::npos)
      continue;
    SCOPED_TRACE(c.name);
    check_backward(c, GetParam().overrides);
    if (HasFatalFailure() || IsSkipped()) return;
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no picked case has a built backward kernel";
}

INSTANTIATE_TEST_SUITE_P(Overrides, Sm90BackwardPlanPath, ::testing::ValuesIn(bwd_plan_paths()),
                         [](const ::testing::TestParamInfo<BwdPlanPath>& info) {
                           return std::string(info.param.name);
                         });

// Deterministic mode: 200 runs bitwise equal (the matrix above checks its values against the
// reference). The default mode is measured beside it: how far its runs differ is printed.
TEST(Sm90Backward, DeterministicRunsAreBitwiseEqual) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_backward_kernels().empty()) GTEST_SKIP() << "this build has no sm90 backward kernel";
  const Kernel k = built_backward_kernels().front();
  for (bool deterministic : {true, false}) {
    Case c = fixed_case(k, {"q300_k600", 2, 300, 600}, Mask::kCausal, kGqa4, false, false);
    c.deterministic = deterministic;
    SCOPED_TRACE(deterministic ? "deterministic" : "default");
    BackwardRun run(c);
    Stream stream;
    prepare_backward(run, stream.get());
    if (::testing::Test::HasFatalFailure()) return;
    const int runs = deterministic ? 200 : 20;
    std::vector<std::vector<uint64_t>> first_bits;
    std::vector<std::vector<double>> first_values;
    double largest_difference = 0.0;
    int differing_runs = 0;
    for (int r = 0; r < runs; ++r) {
      Status status;
      ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, run.workspace.view(), &status));
      ASSERT_TRUE(status.ok()) << status.message;
      bool same = true;
      for (size_t g = 0; g < run.grads.size(); ++g) {
        const HostTensor& t = run.grads[g];
        if (r == 0) {
          first_bits.emplace_back();
          first_values.emplace_back();
          for (int64_t e = 0; e < t.size(); ++e) {
            first_bits[g].push_back(t.bits(e));
            first_values[g].push_back(t.get(e));
          }
          continue;
        }
        for (int64_t e = 0; e < t.size(); ++e) {
          if (t.bits(e) == first_bits[g][size_t(e)]) continue;
          same = false;
          largest_difference =
              std::max(largest_difference, std::fabs(t.get(e) - first_values[g][size_t(e)]));
        }
      }
      differing_runs += same ? 0 : 1;
      if (deterministic) ASSERT_TRUE(same) << "run " << r << " differs from run 0";
    }
    if (!deterministic)
      std::cout << "[ default  ] " << differing_runs << " of " << runs - 1
                << " reruns differ bitwise from the first; largest difference "
                << largest_difference << " (dQ is summed in the order the CTAs get there)\n";
  }
}

// Without a band, dQ's finish kernel starts as the main kernel's last CTAs start and converts a
// (batch entry, head)'s rows once that pair's CTAs have added their dQ (bwd_rows.cuh). On grids
// of several rounds its gradients must stay within a rounding (the sums' order differs) of the
// same problem run the way before the counts: with a window that excludes no key, which the
// launcher treats as a band. A block that read its accumulator early would miss key tiles'
// terms, far beyond that rounding; with GQA the dK / dV kernels after it, launched in stream order,
// would read accumulators the main kernel had not finished were the dQ grid's end not its end.
TEST(Sm90Backward, DqFinishWaitsForItsKeyTiles) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_backward_kernels().empty()) GTEST_SKIP() << "this build has no sm90 backward kernel";
  std::vector<Kernel> kernels;  // the narrow kernel's and the wide kernel's largest
  for (const Kernel& k : built_backward_kernels())
    if (k.dtype == DType::kBF16 && (k.dim_qk == 128 || k.dim_qk == 256)) kernels.push_back(k);
  if (kernels.empty()) kernels.push_back(built_backward_kernels().front());
  for (const Kernel& k : kernels)
    for (Heads heads : {Heads{8, 8}, kGqa4}) {
      // 2 × 8 query heads × 16 (d128) or 32 (d256) key tiles: 256 / 512 CTAs on 132 SMs.
      Case counted = fixed_case(k, {"q2048_k2048", 2, 2048, 2048}, Mask::kNone, heads, false,
                                false);
      SCOPED_TRACE(counted.name);
      Case plain = counted;  // same name: the same inputs
      plain.window = {2048, -1};
      std::vector<std::vector<double>> reference;  // dq, dk, dv
      // The plain run, then four default runs and one deterministic run with the counts.
      for (int r = 0; r < 6; ++r) {
        Case c = r == 0 ? plain : counted;
        c.deterministic = r == 5;
        BackwardRun run(c);
        Stream stream;
        prepare_backward(run, stream.get());
        if (::testing::Test::HasFatalFailure()) return;
        Status status;
        ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, run.workspace.view(), &status));
        ASSERT_TRUE(status.ok()) << status.message;
        for (size_t g = 0; g < run.grads.size(); ++g) {
          const std::vector<double> got = run.grads[g].dense();
          if (r == 0) {
            reference.push_back(got);
            continue;
          }
          const std::vector<double>& want = reference[g];
          ASSERT_EQ(got.size(), want.size());
          double largest = 0.0;
          for (double x : want) largest = std::max(largest, std::fabs(x));
          int64_t off = 0;
          size_t first = 0;
          for (size_t e = 0; e < got.size(); ++e) {
            const double bound = std::ldexp(std::fabs(want[e]), -6) + 1e-3 * largest;
            if (!(std::fabs(got[e] - want[e]) <= bound) && off++ == 0) first = e;
          }
          EXPECT_EQ(off, 0) << kGradNames[g] << ", run " << r << ": differs from the plain run "
                            << "beyond a rounding at " << off << " values, the first at " << first
                            << " (" << got[first] << " against " << want[first] << ")";
        }
      }
    }
}

// 33 query tiles × 33 key tiles, causal: every tile of the band, dQ summed over up to 33 key
// tiles, dK / dV over up to 66 query steps. The reference computes every row (~17 s, a third of
// the suite's reference time), hence one head and one kernel.
TEST(Sm90BackwardLong, Seq4224Causal) {
  if (built_backward_kernels().empty()) GTEST_SKIP() << "this build has no sm90 backward kernel";
  const std::vector<Kernel>& kernels = built_backward_kernels();
  const auto full = std::find_if(kernels.begin(), kernels.end(),
                                 [](const Kernel& k) { return is_full_kernel(k); });
  const Kernel k = full != kernels.end() ? *full : kernels.front();
  Case c = base_case(k, {"", 1, 4224, 4224});
  set_heads(c, {1, 1});
  c.causal = true;
  c.spiky = true;
  c.name = kernel_tag(k) + "_long_q4224_k4224_causal";
  check_backward(c);
}

// ---- Refusals. The backward does not take fp32 or head dims
// without a built kernel: kNotSupported with a message naming the reason.

struct Refusal {
  std::string what;
  Case c;
  std::string reason;  // a word the message must contain (case-insensitive)
};

bool contains_word(std::string text, std::string word) {
  auto lower = [](std::string& s) {
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char ch) { return char(std::tolower(ch)); });
  };
  lower(text);
  lower(word);
  return text.find(word) != std::string::npos;
}

std::vector<Refusal> refusals() {
  // A problem the backward would take but for the one thing each refusal changes.
  const Kernel k = built_backward_kernels().empty() ? Kernel{128, 128, DType::kBF16}
                                              : built_backward_kernels().front();
  Case base = base_case(k, {"", 2, 70, 90});
  set_heads(base, kGqa4);
  base.causal = true;
  std::vector<Refusal> list;
  auto add = [&](const std::string& what, const std::string& reason, auto&& change) {
    Refusal r{what, base, reason};
    change(r.c);
    r.c.name = "refused_" + std::to_string(list.size());
    list.push_back(r);
  };
  add("fp32", "fp32", [](Case& c) { c.dtype = DType::kFP32; });
  // Head dims no backward table entry has, and entries this build may have left out.
  const struct {
    int64_t qk, v;
  } kDims[] = {{32, 32},   {96, 96},   {192, 192}, {192, 128}, {256, 256},
               {128, 64},  {64, 128},  {64, 64},   {128, 128}};
  for (DType dtype : {DType::kBF16, DType::kFP16})
    for (const auto& d : kDims) {
      if (kernel_listed(built_backward_kernels(), d.qk, d.v, dtype)) continue;
      add("no backward kernel " + kernel_tag({d.qk, d.v, dtype}), "head dim", [&](Case& c) {
        c.dim_qk = d.qk;
        c.dim_v = d.v;
        c.dtype = dtype;
      });
    }
  return list;
}

// Host-side answers: they hold with or without a GPU (without one, accepted problems get
// kBackendUnavailable).
TEST(Sm90Backward, CanImplementAnswers) {
  std::string why;
  const bool gpu = hopper_present(&why);
  const StatusCode accepted_code = gpu ? StatusCode::kSuccess : StatusCode::kBackendUnavailable;
  for (const Kernel& k : built_backward_kernels()) {
    std::vector<Case> accepted;
    for (Heads h : {kMha, kGqa4, kMqa}) {
      Case c = base_case(k, {"", 2, 1, 300});
      set_heads(c, h);
      c.name = kernel_tag(k) + gqa_tag(c);
      accepted.push_back(c);
    }
    Case masked = base_case(k, {"", 1, 300, 1});
    masked.causal = true;
    masked.window = kBand;
    masked.softcap = kSoftcap;
    masked.name = kernel_tag(k) + " causal, window, softcap";
    accepted.push_back(masked);
    Case varlen = base_case(k, {"", 0, 0, 0});
    varlen.lens_q = kOdd.lens_q;
    varlen.lens_k = kOdd.lens_k;
    varlen.name = kernel_tag(k) + " varlen";
    accepted.push_back(varlen);
    for (const Case& c : accepted) {
      SCOPED_TRACE(c.name);
      std::mt19937_64 rng = make_rng(c.name);
      // can_implement must not read the arrays (on a GPU they live in device memory).
      const std::unique_ptr<CaseData> s = make_setup(c, rng);
      const Status st = can_implement(s->problem, Backend::kSm90, Pass::kBackward);
      EXPECT_STREQ(to_string(st.code), to_string(accepted_code)) << st.message;
    }
  }
  for (const Refusal& r : refusals()) {
    SCOPED_TRACE(r.what);
    std::mt19937_64 rng = make_rng(r.c.name);
    const std::unique_ptr<CaseData> s = make_setup(r.c, rng);
    const Status st = can_implement(s->problem, Backend::kSm90, Pass::kBackward);
    EXPECT_STREQ(to_string(st.code), to_string(StatusCode::kNotSupported)) << st.message;
    EXPECT_TRUE(contains_word(st.message, r.reason))
        << "the message does not name the reason ('" << r.reason << "'): " << st.message;
  }
}

// The same refusals from backward() itself, on device tensors: nothing written.
TEST(Sm90Backward, RefusalsWriteNothing) {
  FA4_SKIP_WITHOUT_HOPPER();
  constexpr size_t kSpareWorkspace = size_t(1) << 20;  // so that no refusal is about the workspace
  for (const Refusal& r : refusals()) {
    SCOPED_TRACE(r.what);
    SCOPED_TRACE(describe(r.c));
    BackwardRun run(r.c);
    ASSERT_CUDA(run.upload());  // out and LSE stay poisoned: a refused call reads nothing
    ASSERT_CUDA(run.workspace.allocate(kSpareWorkspace));
    ASSERT_CUDA(run.workspace.poison());
    Stream stream;
    Status st;
    ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, run.workspace.view(), &st));
    EXPECT_STREQ(to_string(st.code), to_string(StatusCode::kNotSupported)) << st.message;
    EXPECT_TRUE(contains_word(st.message, r.reason))
        << "the message does not name the reason ('" << r.reason << "'): " << st.message;
    const Problem& p = run.setup->problem;
    const std::vector<unsigned char> no_q(rows_in_sequences(p, false).size(), 0),
        no_k(rows_in_sequences(p, true).size(), 0);
    expect_gradients_written(run, no_q, no_k);
  }
}

// Device tensors with host cu_seqlens: the kernel would read host memory and fault the context,
// so the call must be refused up front, naming the array, with nothing written.
TEST(Sm90Backward, RefusesHostSequenceArrays) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_backward_kernels().empty()) GTEST_SKIP() << "this build has no sm90 backward kernel";
  Case c = varlen_case(built_backward_kernels().front(), kShort, Mask::kCausal, kGqa4, false, false);
  c.name = "host_sequence_arrays";
  BackwardRun run(c);
  Stream stream;
  prepare_backward(run, stream.get());
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<unsigned char> no_q(rows_in_sequences(run.setup->problem, false).size(), 0),
      no_k(rows_in_sequences(run.setup->problem, true).size(), 0);
  for (const std::string array : {"cu_seqlens_q", "cu_seqlens_k"}) {
    SCOPED_TRACE(array);
    Problem p = run.fwd->problem;  // device arrays, but for the one under test
    if (array == "cu_seqlens_q") p.varlen.cu_seqlens_q = run.setup->cu_q.data();
    if (array == "cu_seqlens_k") p.varlen.cu_seqlens_k = run.setup->cu_k.data();
    ASSERT_CUDA(run.poison_gradients());
    const Status st = backward(p, run.tensors, run.workspace.view(), stream.get(),
                               Backend::kSm90, test_overrides());
    EXPECT_STREQ(to_string(st.code), to_string(StatusCode::kInvalidArgument)) << st.message;
    EXPECT_NE(st.message.find(array), std::string::npos) << st.message;
    ASSERT_CUDA(DeviceRun::device_sync());
    ASSERT_CUDA(run.download_gradients());
    expect_gradients_written(run, no_q, no_k);
  }
}

// Keys past a sequence's end in its last, partial key tile load as zeros: unmasked, their
// probability would be exp(−LSE), which for a row of very negative LSE overflows, and dQ would get
// inf · 0 = NaN. One query, one key, q = −11 · 1, k = v = dO = 1: LSE = −11·sqrt(d) ≤ −88, dS = 0 on
// the real key, so dQ = dK = 0 and dV = 1, all finite.
TEST(Sm90Backward, VeryNegativeLseAndAPartialKeyTile) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_backward_kernels().empty()) GTEST_SKIP() << "this build has no sm90 backward kernel";
  for (const Kernel& k : built_backward_kernels()) {
    SCOPED_TRACE(kernel_tag(k));
    const int64_t d = k.dim_qk, dv_dim = k.dim_v;
    Problem p;
    p.batch = p.seqlen_q = p.seqlen_k = p.heads_q = p.heads_kv = 1;
    p.head_dim_qk = d;
    p.head_dim_v = dv_dim;
    p.dtype = k.dtype;
    p.return_lse = true;
    const Dims dims{1, 1, 1, d}, dims_v{1, 1, 1, dv_dim};
    // k = 1 (head dim qk); v = dO = 1 (head dim v).
    HostTensor q(k.dtype, dims), ones(k.dtype, dims), ones_v(k.dtype, dims_v),
        out(k.dtype, dims_v), dq(k.dtype, dims), dk(k.dtype, dims), dv(k.dtype, dims_v);
    for (int64_t i = 0; i < d; ++i) {
      q.set(i, -11.0);
      ones.set(i, 1.0);
    }
    for (int64_t i = 0; i < dv_dim; ++i) ones_v.set(i, 1.0);
    HostLse lse(1, 1, 1, false);
    const size_t elem = k.dtype == DType::kFP16 || k.dtype == DType::kBF16 ? 2 : 4;
    DeviceMirror mq({mirror_view(q)}, elem), mones({mirror_view(ones)}, elem),
        mones_v({mirror_view(ones_v)}, elem), mout({mirror_view(out)}, elem),
        mlse({mirror_view(lse)}, 4), mdq({mirror_view(dq)}, elem), mdk({mirror_view(dk)}, elem),
        mdv({mirror_view(dv)}, elem);
    ASSERT_CUDA(mq.upload());
    ASSERT_CUDA(mones.upload());
    ASSERT_CUDA(mones_v.upload());
    for (DeviceMirror* m : {&mout, &mlse, &mdq, &mdk, &mdv}) ASSERT_CUDA(m->poison());
    ForwardTensors f;
    f.q = mq.device_view(q.view());
    f.k = mones.device_view(ones.view());
    f.v = mones_v.device_view(ones_v.view());
    f.out = mout.device_view(out.view());
    f.lse = mlse.device_view(lse.view());
    ASSERT_TRUE(forward(p, f, {}, nullptr, Backend::kSm90, test_overrides()).ok());
    size_t bytes = 0;
    ASSERT_TRUE(
        workspace_size(p, Backend::kSm90, Pass::kBackward, test_overrides(), &bytes).ok());
    DeviceWorkspace ws;
    ASSERT_CUDA(ws.allocate(bytes));
    ASSERT_CUDA(ws.poison());
    BackwardTensors b;
    b.q = f.q;
    b.k = f.k;
    b.v = b.dout = f.v;
    b.out = f.out;
    b.lse = f.lse;
    b.dq = mdq.device_view(dq.view());
    b.dk = mdk.device_view(dk.view());
    b.dv = mdv.device_view(dv.view());
    const Status st = backward(p, b, ws.view(), nullptr, Backend::kSm90, test_overrides());
    ASSERT_TRUE(st.ok()) << st.message;
    ASSERT_CUDA(DeviceRun::device_sync());
    for (DeviceMirror* m : {&mdq, &mdk, &mdv}) ASSERT_CUDA(m->download(nullptr));
    for (int64_t i = 0; i < d; ++i) {
      EXPECT_LT(std::fabs(dq.get(i)), 1e-2) << "dq[" << i << "]";
      EXPECT_LT(std::fabs(dk.get(i)), 1e-2) << "dk[" << i << "]";
    }
    for (int64_t i = 0; i < dv_dim; ++i)
      EXPECT_LT(std::fabs(dv.get(i) - 1.0), 1e-2) << "dv[" << i << "]";
  }
}

}  // namespace
}  // namespace fa4::test
