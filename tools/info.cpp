// `flashattn info`: what this build holds (version, backends) and what it can see (the CPU's
// threads, the CUDA devices or why there are none).
#include <omp.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Info {
  std::string version;
  bool cuda_compiled = false;
  std::vector<std::string> cuda_architectures;
  int openmp_threads = 0;         // what the CPU backend uses with --threads 0 (OMP_NUM_THREADS)
  unsigned hardware_threads = 0;  // what the machine has
  std::vector<CudaDevice> cuda_devices;
  std::string no_cuda_device_reason;
};

Info gather_info() {
  Info info;
  info.version = flashattn::version();
  info.cuda_compiled = flashattn::cuda_compiled();
  info.cuda_architectures = flashattn::cuda_architectures();
  info.openmp_threads = omp_get_max_threads();
  info.hardware_threads = std::thread::hardware_concurrency();
  info.cuda_devices = flashattn::cuda_devices(&info.no_cuda_device_reason);
  return info;
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string s;
  for (const std::string& item : items) {
    if (!s.empty()) s += separator;
    s += item;
  }
  return s;
}

std::string compute_capability(const CudaDevice& d) {
  return std::to_string(d.compute_capability / 10) + "." +
         std::to_string(d.compute_capability % 10);
}

void print_text(const Info& info) {
  std::string backends = "cpu";
  if (info.cuda_compiled) backends += ", cuda (" + join(info.cuda_architectures, " ") + ")";
  std::cout << "flashattn " << info.version << "\n"
            << "backends   " << backends << "\n"
            << "cpu        " << info.openmp_threads << " threads (OpenMP), "
            << info.hardware_threads << " hardware threads\n";
  if (info.cuda_devices.empty()) {
    std::cout << "cuda       none (" << info.no_cuda_device_reason << ")\n";
    return;
  }
  for (const CudaDevice& d : info.cuda_devices) {
    char memory[32];
    std::snprintf(memory, sizeof memory, "%.1f GiB", static_cast<double>(d.memory_bytes) / kGiB);
    std::cout << "cuda:" << d.index << "     " << d.name << ", compute capability "
              << compute_capability(d) << ", " << memory << ", " << d.multiprocessors << " SMs\n";
  }
}

void print_json(const Info& info) {
  nlohmann::ordered_json backends = nlohmann::ordered_json::array({"cpu"});
  if (info.cuda_compiled) backends.push_back("cuda");
  nlohmann::ordered_json devices = nlohmann::ordered_json::array();
  for (const CudaDevice& d : info.cuda_devices)
    devices.push_back({{"index", d.index},
                       {"name", d.name},
                       {"compute_capability", compute_capability(d)},
                       {"memory_bytes", d.memory_bytes},
                       {"memory_gib", static_cast<double>(d.memory_bytes) / kGiB},
                       {"multiprocessors", d.multiprocessors}});
  nlohmann::ordered_json j = {
      {"version", info.version},
      {"backends", backends},
      {"cuda_compiled", info.cuda_compiled},
      {"cuda_architectures", info.cuda_architectures},
      {"cpu",
       {{"openmp_threads", info.openmp_threads}, {"hardware_threads", info.hardware_threads}}},
      {"cuda_devices", devices},
  };
  if (info.cuda_devices.empty()) j["cuda_devices_none_reason"] = info.no_cuda_device_reason;
  std::cout << j.dump(2) << "\n";
}

}  // namespace

int info_command(bool json) {
  const Info info = gather_info();
  if (json)
    print_json(info);
  else
    print_text(info);
  return 0;
}

}  // namespace flashattn::cli
