// A file in the temporary directory, removed when the object dies: for tests that write inputs
// (traces, snapshots) and read them back. The name is the stem plus the process id, so test
// binaries run in parallel by ctest never share one.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace cucache::test {

class temp_file {
 public:
  explicit temp_file(const std::string& stem)
      : path_(std::filesystem::temp_directory_path() /
              (stem + "." + std::to_string(::getpid()) + ".tmp")) {}
  ~temp_file() { std::filesystem::remove(path_); }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  /// Writes `bytes` as the whole file.
  void write(const std::string& bytes) const { std::ofstream(path_, std::ios::binary) << bytes; }

 private:
  std::filesystem::path path_;
};

}  // namespace cucache::test
