// The subcommands of the flashattn program. flashattn.cpp parses the command line into these
// plain structs; info.cpp and run.cpp do the work. Every command returns the process exit
// status; flashattn::Error (and any other exception) escapes to main, which reports it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace flashattn::cli {

// `flashattn info [--json]`: version, backends compiled in, devices seen.
int info_command(bool json);

// `flashattn run ...`: the arguments as given (--seed seeds both the inputs and dropout). Sizes are int64 so that the library, not the
// parser, judges them (e.g. `--heads 6 --heads-k 4` must reach flashattn::forward).
struct RunArgs {
  std::string backend = "auto";  // auto | cpu | cuda
  int32_t device = 0;            // CUDA device index (cuda backend)
  int64_t batch = 1;
  int64_t seqlen_q = 1024;
  std::optional<int64_t> seqlen_k;  // default: seqlen_q
  int64_t heads = 8;
  std::optional<int64_t> heads_k;  // default: heads
  int64_t head_dim = 64;
  std::optional<std::string> dtype;  // fp32 | fp16 | bf16; default: bf16 on cuda, fp32 on cpu
  bool causal = false;
  int32_t window_left = -1, window_right = -1;  // -1: unbounded
  float softcap = 0.0f;
  std::optional<float> softmax_scale;  // default: 1/sqrt(head_dim), chosen by the library
  bool alibi = false;
  bool varlen = false;
  bool backward = false;        // time (and with --check, check) a backward call too
  float dropout = 0.0f;         // Options::dropout_p; the library judges the range
  bool deterministic = false;   // Options::deterministic
  bool check = false;
  bool json = false;
  int repeat = 5;
  int32_t threads = 0;           // 0: all
  std::optional<uint64_t> seed;  // default: fresh from std::random_device
};

int run_command(const RunArgs& args);

}  // namespace flashattn::cli
