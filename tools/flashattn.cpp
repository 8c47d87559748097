// flashattn: the command-line program. `flashattn info` says what this build holds and sees;
// `flashattn run` times one forward call (and with --backward one backward call) on random
// inputs, optionally checks it against the float64 reference, and reports throughput and memory
// next to what standard attention needs.
//
// The parser only rejects what cannot even be turned into a call (an unknown dtype, a negative
// size to allocate); every real argument check is the library's, so its error messages are the
// ones people see. Exit status: 0 ok, 1 a --check failed, 2 the library rejected the call (or
// another run-time error), CLI11's own codes for command-line mistakes.
#include "flashattn/flashattn.hpp"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>
#include <utility>

#include "commands.hpp"

namespace {

using flashattn::cli::RunArgs;

// "L,R" -> (L, R), e.g. "64,0" or "-1,16"; nullopt when the text is not two int32s.
std::optional<std::pair<int32_t, int32_t>> parse_window(const std::string& text) {
  const auto comma = text.find(',');
  if (comma == std::string::npos) return std::nullopt;
  const auto parse_int = [](const char* begin, const char* end) -> std::optional<int32_t> {
    int32_t value = 0;
    const auto [ptr, ec] = std::from_chars(begin, end, value);
    if (ec != std::errc() || ptr != end || begin == end) return std::nullopt;
    return value;
  };
  const char* s = text.data();
  const auto left = parse_int(s, s + comma);
  const auto right = parse_int(s + comma + 1, s + text.size());
  if (!left || !right) return std::nullopt;
  return std::pair{*left, *right};
}

// An integer option of at least `min`. (CLI11's NonNegativeNumber/PositiveNumber print the
// largest double as the upper bound of their range in the error message.)
CLI::Validator at_least(long long min) {
  const std::string bound = ">= " + std::to_string(min);
  return CLI::Validator(
      [min, bound](const std::string& text) -> std::string {
        long long value = 0;
        if (!CLI::detail::lexical_cast(text, value)) return "expected an integer, given " + text;
        return value >= min ? std::string() : "expected an integer " + bound + ", given " + text;
      },
      min == 0   ? "NONNEGATIVE"
      : min == 1 ? "POSITIVE"
                 : bound);
}

void add_info_command(CLI::App& app, bool& json) {
  CLI::App* info =
      app.add_subcommand("info", "Show the version, the backends compiled in and the devices seen");
  info->add_flag("--json", json, "Print one JSON object instead of text");
}

// Options whose default depends on another option (or on std::random_device) are read into a
// plain variable and copied into the std::optional afterwards, when their count() says whether
// they were given.
struct Deferred {
  CLI::Option* seqlen_k = nullptr;
  CLI::Option* heads_k = nullptr;
  CLI::Option* softmax_scale = nullptr;
  CLI::Option* seed = nullptr;
  CLI::Option* window = nullptr;
  CLI::Option* dtype = nullptr;
  int64_t seqlen_k_value = 0, heads_k_value = 0;
  float softmax_scale_value = 0.0f;
  uint64_t seed_value = 0;
  std::string window_text, dtype_value;
};

// Their real default is computed later and stated in the help text; hide the placeholder 0.
void hide_placeholder_defaults(const Deferred& d) {
  for (CLI::Option* option : {d.seqlen_k, d.heads_k, d.softmax_scale, d.seed, d.dtype})
    option->default_str("");
}

CLI::App* add_run_command(CLI::App& app, RunArgs& a, Deferred& d) {
  CLI::App* run = app.add_subcommand(
      "run",
      "Time one forward call (and with --backward one backward call) on random inputs; "
      "optionally check them against the float64 reference");
  run->option_defaults()->always_capture_default();
  // Negative sizes cannot be allocated; every other judgement on sizes is the library's.
  const CLI::Validator sizes = at_least(0);

  run->add_option("--backend", a.backend, "Backend to run on")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  run->add_option("--device", a.device, "CUDA device index (when the run is on cuda)")
      ->check(at_least(0));
  run->add_option("--batch", a.batch, "Batch size B (number of sequences with --varlen)")
      ->check(sizes);
  run->add_option("--seqlen-q", a.seqlen_q, "Query length Sq (the longest one with --varlen)")
      ->check(sizes);
  d.seqlen_k = run->add_option("--seqlen-k", d.seqlen_k_value, "Key length Sk [default: seqlen-q]")
                   ->check(sizes);
  run->add_option("--heads", a.heads, "Query heads H")->check(sizes);
  d.heads_k = run->add_option("--heads-k", d.heads_k_value, "Key/value heads Hk [default: heads]")
                  ->check(sizes);
  run->add_option("--head-dim", a.head_dim, "Head dimension D")->check(sizes);
  d.dtype = run->add_option("--dtype", d.dtype_value,
                            "Element type of q, k, v and out [default: bf16 on cuda, fp32 on cpu]")
                ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  run->add_flag("--causal", a.causal, "Causal mask (bottom-right aligned)");
  d.window =
      run->add_option("--window", d.window_text,
                      "Local window L,R in keys (-1: unbounded), e.g. 64,0 or -1,16")
          ->check([](const std::string& text) {
            return parse_window(text) ? std::string() : "expected L,R with two integers, e.g. 64,0";
          });
  run->add_option("--softcap", a.softcap, "Softcap c: s = c tanh(s/c); 0 is off");
  d.softmax_scale = run->add_option("--softmax-scale", d.softmax_scale_value,
                                    "Softmax scale [default: 1/sqrt(head-dim)]");
  run->add_flag("--alibi", a.alibi, "ALiBi with slopes 2^(-8(h+1)/H)");
  run->add_flag("--varlen", a.varlen,
                "Ragged batch of random lengths (the first sequence has the full lengths)");
  run->add_flag("--backward", a.backward,
                "Also time the backward pass (random dout) and report forward + backward");
  run->add_option("--dropout", a.dropout,
                  "Dropout probability P in [0, 1); its seed is --seed, its offset 0");
  run->add_flag("--deterministic", a.deterministic,
                "Ask for bitwise reproducible gradients (Options::deterministic)");
  run->add_flag("--check", a.check,
                "Check out and lse (with --backward also dq, dk, dv) against the float64 "
                "reference (exit 1 on failure)");
  run->add_flag("--json", a.json, "Print one JSON object instead of text");
  run->add_option("--repeat", a.repeat, "Timed runs after one warm-up run")->check(at_least(1));
  run->add_option("--threads", a.threads, "CPU threads; 0 = all")->check(at_least(0));
  d.seed = run->add_option("--seed", d.seed_value,
                           "Seed of the inputs (and of dropout) [default: fresh random, printed "
                           "for replay]");
  hide_placeholder_defaults(d);
  return run;
}

void apply_deferred(RunArgs& a, const Deferred& d) {
  if (d.seqlen_k->count() > 0) a.seqlen_k = d.seqlen_k_value;
  if (d.heads_k->count() > 0) a.heads_k = d.heads_k_value;
  if (d.softmax_scale->count() > 0) a.softmax_scale = d.softmax_scale_value;
  if (d.seed->count() > 0) a.seed = d.seed_value;
  if (d.dtype->count() > 0) a.dtype = d.dtype_value;
  if (d.window->count() > 0) std::tie(a.window_left, a.window_right) = *parse_window(d.window_text);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flashattn: exact attention that never materialises the score matrix", "flashattn"};
  app.set_version_flag("--version", std::string("flashattn ") + flashattn::version());
  app.require_subcommand(1);

  bool info_json = false;
  add_info_command(app, info_json);
  RunArgs run_args;
  Deferred deferred;
  const CLI::App* run = add_run_command(app, run_args, deferred);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (run->parsed()) {
      apply_deferred(run_args, deferred);
      return flashattn::cli::run_command(run_args);
    }
    return flashattn::cli::info_command(info_json);
  } catch (const std::exception& e) {  // flashattn::Error above all; also bad_alloc and the like
    std::cerr << "flashattn: error: " << e.what() << "\n";
    return 2;
  }
}
