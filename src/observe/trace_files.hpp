// Reading a trace file's bytes whole (trace_reader.cpp), for formats that are not read line by
// line: PyTorch's memory snapshots (snapshot_reader.cpp).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace cucache::detail {

/// At most `limit` bytes of the file, decompressed when it is gzip (told by its magic bytes; every
/// member read, and anything after the last one refused, as read_trace does). Throws
/// cucache::invalid_argument naming the file when it cannot be opened, read or decompressed.
[[nodiscard]] std::string read_file_bytes(const std::filesystem::path& path, std::size_t limit);

}  // namespace cucache::detail
