#include "options.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace fa4::bench {
namespace {

// Thrown for a malformed command line; caught in parse_args and turned into a ParseResult.
struct UsageError {
  std::string message;
};

int64_t parse_int(const std::string& option, const std::string& text, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError{option + " expects an integer, got '" + text + "'"};
  if (v < lo || v > hi) {
    std::ostringstream msg;
    msg << option << " must be in [" << lo << ", " << hi << "], got " << v;
    throw UsageError{msg.str()};
  }
  return v;
}

float parse_float(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const float v = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    throw UsageError{option + " expects a finite number, got '" + text + "'"};
  return v;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    const auto pos = text.find(sep, start);
    parts.push_back(text.substr(start, pos - start));
    if (pos == std::string::npos) return parts;
    start = pos + 1;
  }
}

std::vector<int32_t> parse_lengths(const std::string& option, const std::string& text) {
  std::vector<int32_t> lengths;
  for (const std::string& part : split(text, ':'))
    lengths.push_back(int32_t(parse_int(option, part, 0, std::numeric_limits<int32_t>::max())));
  return lengths;
}

Window parse_window(const std::string& text) {
  const auto parts = split(text, ',');
  if (parts.size() != 2) throw UsageError{"--window expects L,R (e.g. 128,0; -1 = unbounded), got '" + text + "'"};
  const int64_t max = std::numeric_limits<int64_t>::max();
  return Window{parse_int("--window", parts[0], -1, max), parse_int("--window", parts[1], -1, max)};
}

DType parse_dtype(const std::string& text) {
  if (text == "bf16") return DType::kBF16;
  if (text == "fp16") return DType::kFP16;
  if (text == "fp32") return DType::kFP32;
  throw UsageError{"--dtype expects bf16, fp16 or fp32, got '" + text + "'"};
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
  }
  return "?";
}

std::string usage() {
  return R"(usage: fa4-bench [options]

Runs attention forward and/or backward for one problem with fa4cpp, reports the median time and
TFLOP/s, and checks a sample of the results against a double-precision reference.

Backend and measurement:
  --backend B        auto | cpu | sm90 (default auto: sm90 when built with CUDA and a GPU is
                     present, else cpu)
  --pass P           fwd | bwd | both (default fwd)
  --warmup N         untimed runs before timing (default 5 on GPU, 1 on CPU)
  --iters N          timed runs; the median is reported (default 50 on GPU, 3 on CPU)
  --check N          query rows sampled and compared with the reference (default 32; 0 = off);
                     backward is checked in full when the problem has <= 2^26 scores
  --seed N           random seed of the inputs and the sample (default: a fresh one, printed)
  --json FILE        also write the results as one JSON object to FILE

Problem:
  --dtype T          bf16 | fp16 | fp32 (default bf16; fp32 runs on the CPU backend only)
  --batch N          batch size (default 2)
  --seqlen N         query and key length (default 1024)
  --seqlen-q N       query length
  --seqlen-k N       key length
  --heads N          query heads (default 16)
  --heads-kv N       key/value heads, dividing --heads (default: --heads)
  --head-dim N       head dim of q and k (default 128)
  --head-dim-v N     head dim of v and the output (default: --head-dim)
  --causal           causal mask, aligned bottom-right
  --window L,R       sliding window of L keys left and R right of the diagonal (-1 = unbounded)
  --softcap X        score = X * tanh(score / X) (default 0 = off)
  --scale X          softmax scale (default 1/sqrt(head dim))
  --varlen L1:L2:..  variable-length batch: query lengths of each sequence (sets batch and
                     seqlens; a length may be 0)
  --varlen-k L1:..   key lengths of each sequence (default: the --varlen lengths)
  --seqused-k U1:..  keys used by each sequence (<= its key length)
  --lse              the forward pass also writes the log-sum-exp
  --deterministic    bitwise-reproducible backward

Exit status: 0 success, 1 a check failed, 2 bad command line or the backend cannot run the
problem, 3 a run failed (device or library error).
Examples:
  fa4-bench --seqlen 4096 --causal --pass both
  fa4-bench --backend cpu --dtype fp16 --varlen 177:366:479 --varlen-k 257:0:766 --heads 8 --heads-kv 2
)";
}

ParseResult parse_args(int argc, char** argv) {
  ParseResult result;
  Options& o = result.options;
  std::set<std::string> seen;
  const int64_t max64 = std::numeric_limits<int64_t>::max();
  const int64_t max32 = std::numeric_limits<int32_t>::max();

  // Options that take a value, by name; flags are handled separately below.
  const std::map<std::string, std::function<void(const std::string&)>> valued = {
      {"--backend",
       [&](const std::string& v) {
         if (v != "auto" && v != "cpu" && v != "sm90")
           throw UsageError{"--backend expects auto, cpu or sm90, got '" + v + "'"};
         o.backend_name = v;
       }},
      {"--pass",
       [&](const std::string& v) {
         if (v == "fwd") o.run_forward = true, o.run_backward = false;
         else if (v == "bwd") o.run_forward = false, o.run_backward = true;
         else if (v == "both") o.run_forward = true, o.run_backward = true;
         else throw UsageError{"--pass expects fwd, bwd or both, got '" + v + "'"};
       }},
      {"--batch", [&](const std::string& v) { o.batch = parse_int("--batch", v, 1, max32); }},
      {"--seqlen",
       [&](const std::string& v) { o.seqlen_q = o.seqlen_k = parse_int("--seqlen", v, 0, max32); }},
      {"--seqlen-q", [&](const std::string& v) { o.seqlen_q = parse_int("--seqlen-q", v, 0, max32); }},
      {"--seqlen-k", [&](const std::string& v) { o.seqlen_k = parse_int("--seqlen-k", v, 0, max32); }},
      {"--heads", [&](const std::string& v) { o.heads_q = parse_int("--heads", v, 1, max32); }},
      {"--heads-kv", [&](const std::string& v) { o.heads_kv = parse_int("--heads-kv", v, 1, max32); }},
      {"--head-dim", [&](const std::string& v) { o.head_dim = parse_int("--head-dim", v, 1, max32); }},
      {"--head-dim-v",
       [&](const std::string& v) { o.head_dim_v = parse_int("--head-dim-v", v, 1, max32); }},
      {"--dtype", [&](const std::string& v) { o.dtype = parse_dtype(v); }},
      {"--window", [&](const std::string& v) { o.window = parse_window(v); }},
      {"--softcap", [&](const std::string& v) { o.softcap = parse_float("--softcap", v); }},
      {"--scale", [&](const std::string& v) { o.scale = parse_float("--scale", v); }},
      {"--varlen", [&](const std::string& v) { o.varlen_q = parse_lengths("--varlen", v); }},
      {"--varlen-k", [&](const std::string& v) { o.varlen_k = parse_lengths("--varlen-k", v); }},
      {"--seqused-k", [&](const std::string& v) { o.seqused_k = parse_lengths("--seqused-k", v); }},
      {"--warmup", [&](const std::string& v) { o.warmup = int(parse_int("--warmup", v, 0, max32)); }},
      {"--iters", [&](const std::string& v) { o.iters = int(parse_int("--iters", v, 1, max32)); }},
      {"--check", [&](const std::string& v) { o.check_rows = int(parse_int("--check", v, 0, max32)); }},
      {"--json",
       [&](const std::string& v) {
         if (v.empty()) throw UsageError{"--json expects a file name"};
         o.json_path = v;
       }},
      {"--seed",
       [&](const std::string& v) {
         o.seed = uint64_t(parse_int("--seed", v, 0, max64));
         o.seed_given = true;
       }},
  };

  try {
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "-h" || arg == "--help") {
        result.kind = ParseResult::kHelp;
        return result;
      }
      std::string value;
      bool has_inline_value = false;
      if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
        has_inline_value = true;
      }
      if (arg == "--causal" || arg == "--lse" || arg == "--deterministic") {
        if (has_inline_value) throw UsageError{arg + " takes no value"};
        if (arg == "--causal") o.causal = true;
        if (arg == "--lse") o.lse = true;
        if (arg == "--deterministic") o.deterministic = true;
      } else if (const auto it = valued.find(arg); it != valued.end()) {
        if (!has_inline_value) {
          if (i + 1 >= argc) throw UsageError{arg + " expects a value"};
          value = argv[++i];
        }
        it->second(value);
      } else {
        throw UsageError{"unknown option '" + arg + "'"};
      }
      seen.insert(arg);
    }

    if (!o.varlen_q.empty()) {
      for (const char* fixed : {"--batch", "--seqlen", "--seqlen-q", "--seqlen-k"})
        if (seen.count(fixed))
          throw UsageError{std::string(fixed) + " cannot be combined with --varlen, which sets the batch and lengths"};
      if (o.varlen_k.empty()) o.varlen_k = o.varlen_q;
      if (o.varlen_k.size() != o.varlen_q.size())
        throw UsageError{"--varlen-k must list as many sequences as --varlen"};
    } else if (!o.varlen_k.empty()) {
      throw UsageError{"--varlen-k needs --varlen (the query lengths)"};
    }
    if (!o.seqused_k.empty()) {
      const size_t batch = o.varlen_q.empty() ? size_t(o.batch) : o.varlen_q.size();
      if (o.seqused_k.size() != batch)
        throw UsageError{"--seqused-k must list one count per sequence (" + std::to_string(batch) + ")"};
    }
    if (o.heads_kv == 0) o.heads_kv = o.heads_q;
    if (o.head_dim_v == 0) o.head_dim_v = o.head_dim;
  } catch (const UsageError& e) {
    result.kind = ParseResult::kError;
    result.error = e.message;
  }
  return result;
}

}  // namespace fa4::bench
