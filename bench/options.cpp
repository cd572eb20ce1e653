#include "options.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>

#include <CLI/CLI.hpp>

namespace fa4::bench {
namespace {

constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMax64 = std::numeric_limits<int64_t>::max();

// A command line that parses but describes nothing fa4-bench can run (options that contradict
// each other); caught in parse_args and turned into a ParseResult.
struct UsageError {
  std::string message;
};

// The value of one option read by a validator: CLI11 reports the message after the option's name
// ("--batch: must be in [1, 2147483647], got 0").
[[noreturn]] void invalid(const std::string& message) { throw CLI::ValidationError(message); }

// Base 10 only: CLI11's own conversion reads 010 as octal and 0x10 as hexadecimal.
int64_t parse_int(const std::string& text, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) invalid("expects an integer, got '" + text + "'");
  if (v < lo || v > hi)
    invalid("must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(v));
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

// CLI11 validators run on the text before CLI11 converts it to the option's type. This one
// rewrites the value as the plain decimal that parse_int read, so CLI11 stores that number.
CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) {
        text = std::to_string(parse_int(text, lo, hi));
        return std::string();
      },
      "", "integer_in");
}

CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& text) {
        errno = 0;
        char* end = nullptr;
        const float v = std::strtof(text.c_str(), &end);
        if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
          return "expects a finite number, got '" + text + "'";
        return std::string();
      },
      "", "finite_number");
}

// `expected` lists the choices for the message, e.g. "auto, cpu or sm90".
CLI::Validator one_of(std::vector<std::string> choices, std::string expected) {
  return CLI::Validator(
      [choices, expected](std::string& text) {
        for (const std::string& c : choices)
          if (text == c) return std::string();
        return "expects " + expected + ", got '" + text + "'";
      },
      "", "one_of");
}

std::vector<int32_t> parse_lengths(const std::string& text) {
  std::vector<int32_t> lengths;
  for (const std::string& part : split(text, ':')) lengths.push_back(int32_t(parse_int(part, 0, kMax32)));
  return lengths;
}

Window parse_window(const std::string& text) {
  const auto parts = split(text, ',');
  if (parts.size() != 2) invalid("expects L,R (e.g. 128,0; -1 = unbounded), got '" + text + "'");
  return Window{parse_int(parts[0], -1, kMax64), parse_int(parts[1], -1, kMax64)};
}

DType dtype_from(const std::string& name) {
  if (name == "fp16") return DType::kFP16;
  if (name == "fp32") return DType::kFP32;
  return DType::kBF16;
}

// Option values that Options holds in another form.
struct Raw {
  std::string pass = "both";
  std::string dtype = "bf16";
};

const char* const kMeasurement = "Backend and measurement";
const char* const kProblem = "Problem";

// Every option, stored into `o` and `raw` when `app` parses. The descriptions state the defaults
// themselves: several depend on the backend or on another option.
void define_options(CLI::App& app, Options& o, Raw& raw) {
  app.name("fa4-bench");
  app.description(
      "Runs attention forward and/or backward for one problem with fa4cpp, reports the median time\n"
      "and TFLOP/s, and checks a sample of the results against a double-precision reference.\n");
  app.footer(
      "Exit status: 0 success, 1 a check failed, 2 bad command line or the backend cannot run the\n"
      "problem, 3 a run failed (device or library error).\n"
      "Examples:\n"
      "  fa4-bench --seqlen 4096 --causal\n"
      "  fa4-bench --backend cpu --dtype fp16 --varlen 177:366:479 --varlen-k 257:0:766 --heads 8 --heads-kv 2");
  app.set_help_flag("-h,--help", "print this help and exit")->group(kMeasurement);
  app.get_formatter()->column_width(21);
  // A repeated option takes its last value, so a script's defaults can be overridden by appending.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  auto integer = [&](const char* name, auto& field, int64_t lo, int64_t hi, const char* group,
                     const char* help) {
    return app.add_option(name, field, help)->transform(integer_in(lo, hi))->type_name("N")->group(group);
  };
  // Options whose text `read` parses (read reports a bad value through invalid()).
  auto text = [&](const char* name, const char* type, std::function<void(const std::string&)> read,
                  const char* help) {
    const std::string description = help;
    return app.add_option(name, description)
        ->each([read](const std::string& v) { read(v); })
        ->type_name(type)
        ->group(kProblem);
  };

  app.add_option("--backend", o.backend_name,
                 "auto | cpu | sm90 (default auto: sm90 when built with CUDA and a GPU is\n"
                 "present, else cpu)")
      ->check(one_of({"auto", "cpu", "sm90"}, "auto, cpu or sm90"))
      ->type_name("B")
      ->group(kMeasurement);
  app.add_option("--pass", raw.pass, "fwd | bwd | both (default both)")
      ->check(one_of({"fwd", "bwd", "both"}, "fwd, bwd or both"))
      ->type_name("P")
      ->group(kMeasurement);
  integer("--warmup", o.warmup, 0, kMax32, kMeasurement,
          "untimed runs before timing (default 5 on GPU, 1 on CPU)");
  integer("--iters", o.iters, 1, kMax32, kMeasurement,
          "timed runs; the median is reported (default 50 on GPU, 3 on CPU)");
  integer("--check", o.check_rows, 0, kMax32, kMeasurement,
          "query rows sampled and compared with the reference (default 32; 0 = off);\n"
          "backward is checked in full when the problem has <= 2^26 scores");
  integer("--seed", o.seed, 0, kMax64, kMeasurement,
          "random seed of the inputs and the sample (default: a fresh one, printed)")
      ->each([&o](const std::string&) { o.seed_given = true; });
  app.add_option("--json", o.json_path, "also write the results as one JSON object to FILE")
      ->check(CLI::Validator(
          [](std::string& v) { return v.empty() ? std::string("expects a file name") : std::string(); }, "",
          "file_name"))
      ->type_name("FILE")
      ->group(kMeasurement);

  app.add_option("--dtype", raw.dtype, "bf16 | fp16 | fp32 (default bf16; fp32 runs on the CPU backend only)")
      ->check(one_of({"bf16", "fp16", "fp32"}, "bf16, fp16 or fp32"))
      ->type_name("T")
      ->group(kProblem);
  integer("--batch", o.batch, 1, kMax32, kProblem, "batch size (default 2)");
  // Defined before --seqlen-q and --seqlen-k: CLI11 stores values in the order options are
  // defined, so the specific length wins over --seqlen whatever their order on the command line.
  app.add_option_function<int64_t>(
         "--seqlen", [&o](const int64_t& n) { o.seqlen_q = o.seqlen_k = n; },
         "query and key length (default 1024; --seqlen-q, --seqlen-k override it)")
      ->transform(integer_in(0, kMax32))
      ->type_name("N")
      ->group(kProblem);
  integer("--seqlen-q", o.seqlen_q, 0, kMax32, kProblem, "query length");
  integer("--seqlen-k", o.seqlen_k, 0, kMax32, kProblem, "key length");
  integer("--heads", o.heads_q, 1, kMax32, kProblem, "query heads (default 16)");
  integer("--heads-kv", o.heads_kv, 1, kMax32, kProblem, "key/value heads, dividing --heads (default: --heads)");
  integer("--head-dim", o.head_dim, 1, kMax32, kProblem, "head dim of q and k (default 128)");
  integer("--head-dim-v", o.head_dim_v, 1, kMax32, kProblem,
          "head dim of v and the output (default: --head-dim)");
  app.add_flag("--causal", o.causal, "causal mask, aligned bottom-right")->disable_flag_override()->group(kProblem);
  text("--window", "L,R", [&o](const std::string& v) { o.window = parse_window(v); },
       "sliding window of L keys left and R right of the diagonal (-1 = unbounded)");
  app.add_option("--softcap", o.softcap, "score = X * tanh(score / X) (default 0 = off)")
      ->check(finite_number())
      ->type_name("X")
      ->group(kProblem);
  app.add_option("--scale", o.scale, "softmax scale (default 1/sqrt(head dim))")
      ->check(finite_number())
      ->type_name("X")
      ->group(kProblem);
  text("--varlen", "L1:L2:..", [&o](const std::string& v) { o.varlen_q = parse_lengths(v); },
       "variable-length batch: query lengths of each sequence (sets batch and\n"
       "seqlens; a length may be 0)");
  text("--varlen-k", "L1:..", [&o](const std::string& v) { o.varlen_k = parse_lengths(v); },
       "key lengths of each sequence (default: the --varlen lengths)");
  text("--seqused-k", "U1:..", [&o](const std::string& v) { o.seqused_k = parse_lengths(v); },
       "keys used by each sequence (<= its key length)");
  app.add_flag("--lse", o.lse, "the forward pass also writes the log-sum-exp")->disable_flag_override()->group(kProblem);
  app.add_flag("--deterministic", o.deterministic, "bitwise-reproducible backward")
      ->disable_flag_override()
      ->group(kProblem);
}

// What CLI11 cannot check option by option: combinations, and the defaults taken from other options.
void finish(const CLI::App& app, const Raw& raw, Options& o) {
  o.run_forward = raw.pass != "bwd";
  o.run_backward = raw.pass != "fwd";
  o.dtype = dtype_from(raw.dtype);
  if (!o.varlen_q.empty()) {
    for (const char* fixed : {"--batch", "--seqlen", "--seqlen-q", "--seqlen-k"})
      if (app.count(fixed) > 0)
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
}

}  // namespace

std::string usage() {
  CLI::App app;
  Options o;
  Raw raw;
  define_options(app, o, raw);
  return app.help();
}

ParseResult parse_args(int argc, char** argv) {
  ParseResult result;
  CLI::App app;
  Raw raw;
  define_options(app, result.options, raw);
  try {
    app.parse(argc, argv);
    finish(app, raw, result.options);
  } catch (const CLI::CallForHelp&) {
    result.kind = ParseResult::kHelp;
  } catch (const CLI::ParseError& e) {
    result.kind = ParseResult::kError;
    result.error = e.what();
  } catch (const UsageError& e) {
    result.kind = ParseResult::kError;
    result.error = e.message;
  }
  return result;
}

}  // namespace fa4::bench
