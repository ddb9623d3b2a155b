// A strict reader of Python pickles of plain data: what torch.cuda.memory._dump_snapshot writes
// (a dict of lists, dicts, strings, numbers, booleans and None, pickled with protocol 2 to 5).
//
// It is a decoder, not an unpickler: it understands exactly the opcodes that build such values
// (docs/decisions/0017-pickle-reader.md lists them) and refuses every other one -- GLOBAL,
// STACK_GLOBAL, REDUCE, BUILD, NEWOBJ, INST, OBJ, PERSID, EXT*, sets, bytearrays, the text
// opcodes of protocol 0 -- with cucache::invalid_argument naming the opcode and its byte offset.
// Nothing in the input is ever executed or looked up: a pickle that names a class or a callable
// is refused at that opcode.
//
// The value built is a graph in one arena (pickle_document): the memo lets a pickle refer to an
// object twice (PyTorch's snapshots share frame dicts between events), so containers hold node
// indices, and a shared object is stored once. A pickle can make a container hold itself (a list
// appended to itself); readers of a document therefore walk it to a bounded depth, never
// recursively without a limit. Memory is linear in the input: each opcode adds at most one node
// or one reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cucache::detail {

class pickle_document;
class pickle_decoder;

/// A value in a pickle_document (a view: valid while the document lives).
class pickle_value {
 public:
  enum class kind : std::uint8_t { none, boolean, integer, floating, string, bytes, list, tuple, dict };

  pickle_value() = default;
  pickle_value(const pickle_document* doc, std::uint32_t index) : doc_(doc), index_(index) {}

  [[nodiscard]] kind type() const;
  [[nodiscard]] bool is(kind k) const { return type() == k; }
  /// The Python spelling of the type ("dict", "int", "NoneType", ...), for messages.
  [[nodiscard]] std::string_view type_name() const;

  [[nodiscard]] bool as_bool() const;  // boolean only
  /// An int that fits in 64 bits, signed or not. std::nullopt for another type or a larger int.
  [[nodiscard]] std::optional<std::int64_t> as_int64() const;
  [[nodiscard]] std::optional<std::uint64_t> as_uint64() const;
  [[nodiscard]] std::optional<double> as_double() const;  // float, or int (exactly or nearly)
  /// str (UTF-8, as pickled) or bytes.
  [[nodiscard]] std::string_view text() const;

  /// list and tuple: the items; dict: the number of keys.
  [[nodiscard]] std::size_t size() const;
  [[nodiscard]] pickle_value at(std::size_t i) const;  // list and tuple
  /// dict: the value under the str key `key`, or std::nullopt (also for a non-dict).
  [[nodiscard]] std::optional<pickle_value> get(std::string_view key) const;
  /// dict: the i-th key and value, in pickle order.
  [[nodiscard]] pickle_value key_at(std::size_t i) const;
  [[nodiscard]] pickle_value value_at(std::size_t i) const;

  [[nodiscard]] std::uint32_t index() const { return index_; }

 private:
  const pickle_document* doc_ = nullptr;
  std::uint32_t index_ = 0;
};

class pickle_document {
 public:
  [[nodiscard]] pickle_value root() const { return {this, root_}; }
  /// Nodes made: a measure of the document's size.
  [[nodiscard]] std::size_t nodes() const { return nodes_.size(); }
  /// The pickle protocol (its PROTO opcode).
  [[nodiscard]] int protocol() const { return protocol_; }

  struct node {
    pickle_value::kind k = pickle_value::kind::none;
    bool negative = false;  // integer: the sign; magnitude in u
    bool big = false;       // integer: does not fit in 64 bits (kept as a fact, not a value)
    std::uint64_t u = 0;    // integer magnitude, boolean, or string: offset into text_
    double d = 0.0;         // floating
    std::uint32_t len = 0;  // string and bytes: length in text_
    std::vector<std::uint32_t> items;  // list/tuple items; dict keys and values interleaved
  };

 private:
  friend class pickle_value;
  friend class pickle_decoder;
  std::vector<node> nodes_;
  std::string text_;
  std::uint32_t root_ = 0;
  int protocol_ = 0;
};

/// Decodes `data`, one pickle (protocol 2 to 5, ending in STOP; nothing may follow it). Throws
/// cucache::invalid_argument "<name>: pickle: <reason> at byte <offset>" for anything else:
/// an opcode outside the plain-data set (named, e.g. "opcode GLOBAL (0x63) ... refused"), a
/// truncated argument, an empty stack or missing MARK, a memo index never stored, a dict key that
/// cannot be hashed by Python (a list or dict), a protocol outside 2-5, bytes after STOP.
[[nodiscard]] pickle_document parse_pickle(std::string_view data, std::string_view name);

/// Whether `data` starts as a pickle of protocol 2 or later does (the PROTO opcode, 0x80).
[[nodiscard]] inline bool looks_like_pickle(std::string_view data) {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x80;
}

}  // namespace cucache::detail
