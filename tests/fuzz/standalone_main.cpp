// The fuzz harnesses' driver where libFuzzer is not available (gcc, or a build without
// CUCACHE_BUILD_FUZZERS): runs LLVMFuzzerTestOneInput on every file named (directories: every
// file inside, sorted), then on `--random N` inputs made by mutating those files and from random
// bytes (`--seed S`, `--max-len L`). A failed check aborts, as under libFuzzer. This is how the
// corpus -- seeds and every crash found so far -- is replayed as a regression test in every build.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

std::vector<std::uint8_t> read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void run(const std::vector<std::uint8_t>& input) {
  // A copy of exactly the input's size, so that AddressSanitizer sees reads past its end.
  std::unique_ptr<std::uint8_t[]> copy(new std::uint8_t[input.size()]);
  std::copy(input.begin(), input.end(), copy.get());
  LLVMFuzzerTestOneInput(copy.get(), input.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::uint64_t random_inputs = 0, seed = 1;
  std::size_t max_len = 4096;
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--random" && i + 1 < argc) {
      random_inputs = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--max-len" && i + 1 < argc) {
      max_len = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::filesystem::path> in_dir;
      for (const auto& e : std::filesystem::directory_iterator(a)) {
        if (e.is_regular_file()) in_dir.push_back(e.path());
      }
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.emplace_back(a);
    }
  }
  std::vector<std::vector<std::uint8_t>> corpus;
  for (const auto& f : files) {
    corpus.push_back(read_file(f));
    run(corpus.back());
  }
  std::mt19937_64 rng(seed);
  for (std::uint64_t n = 0; n < random_inputs; ++n) {
    std::vector<std::uint8_t> input;
    if (!corpus.empty() && rng() % 4 != 0) {
      // Mutate a corpus entry: flip, insert, erase or overwrite a few bytes.
      input = corpus[rng() % corpus.size()];
      const int edits = 1 + static_cast<int>(rng() % 8);
      for (int e = 0; e < edits; ++e) {
        const std::size_t at = input.empty() ? 0 : rng() % input.size();
        switch (rng() % 4) {
          case 0:
            if (!input.empty()) input[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            input.insert(input.begin() + static_cast<std::ptrdiff_t>(at),
                         static_cast<std::uint8_t>(rng()));
            break;
          case 2:
            if (!input.empty()) input.erase(input.begin() + static_cast<std::ptrdiff_t>(at));
            break;
          default:
            if (!input.empty()) input[at] = static_cast<std::uint8_t>(rng());
            break;
        }
      }
      if (input.size() > max_len) input.resize(max_len);
    } else {
      input.resize(rng() % (max_len + 1));
      for (auto& b : input) b = static_cast<std::uint8_t>(rng());
    }
    run(input);
  }
  std::printf("cucache fuzz driver: %zu corpus inputs and %llu random inputs ran clean\n",
              corpus.size(), static_cast<unsigned long long>(random_inputs));
  return 0;
}
