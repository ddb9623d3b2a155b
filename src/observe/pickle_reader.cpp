// The strict plain-data pickle decoder (pickle_reader.hpp). Opcodes are those of Python's pickle
// format, protocols 2 to 5 (the opcode table of Python's pickletools documents each); only the
// ones that build dicts, lists, tuples, strings, bytes, numbers, booleans and None, plus the
// memo, mark, frame and stack opcodes, are understood. The stack follows Python's unpickler: MARK
// opens a new fence, and an opcode that pops values may not pop below the innermost fence.
#include "observe/pickle_reader.hpp"

#include <bit>
#include <cstring>
#include <limits>
#include <unordered_map>

#include <fmt/format.h>

#include "cucache/errors.hpp"

namespace cucache::detail {

namespace {

using kind = pickle_value::kind;

struct opcode_name {
  unsigned char code;
  const char* name;
  /// Why it is refused (nullptr: understood).
  const char* refusal;
};

constexpr const char* k_object = "it names or builds a Python object";
constexpr const char* k_text_protocol = "a protocol 0/1 text opcode, which protocol 2-5 pickles of plain data do not use";
constexpr const char* k_not_plain = "not a value of a snapshot (dict, list, tuple, str, bytes, int, float, bool, None)";

constexpr opcode_name k_opcodes[] = {
    {0x28, "MARK", nullptr},
    {0x2e, "STOP", nullptr},
    {0x30, "POP", nullptr},
    {0x31, "POP_MARK", nullptr},
    {0x32, "DUP", nullptr},
    {0x46, "FLOAT", k_text_protocol},
    {0x49, "INT", k_text_protocol},
    {0x4a, "BININT", nullptr},
    {0x4b, "BININT1", nullptr},
    {0x4c, "LONG", k_text_protocol},
    {0x4d, "BININT2", nullptr},
    {0x4e, "NONE", nullptr},
    {0x50, "PERSID", k_object},
    {0x51, "BINPERSID", k_object},
    {0x52, "REDUCE", k_object},
    {0x53, "STRING", k_text_protocol},
    {0x54, "BINSTRING", "a Python 2 str, which Python 3 does not write for str or bytes"},
    {0x55, "SHORT_BINSTRING", "a Python 2 str, which Python 3 does not write for str or bytes"},
    {0x56, "UNICODE", k_text_protocol},
    {0x58, "BINUNICODE", nullptr},
    {0x61, "APPEND", nullptr},
    {0x62, "BUILD", k_object},
    {0x63, "GLOBAL", k_object},
    {0x64, "DICT", k_text_protocol},
    {0x7d, "EMPTY_DICT", nullptr},
    {0x65, "APPENDS", nullptr},
    {0x67, "GET", k_text_protocol},
    {0x68, "BINGET", nullptr},
    {0x69, "INST", k_object},
    {0x6a, "LONG_BINGET", nullptr},
    {0x6c, "LIST", k_text_protocol},
    {0x5d, "EMPTY_LIST", nullptr},
    {0x6f, "OBJ", k_object},
    {0x70, "PUT", k_text_protocol},
    {0x71, "BINPUT", nullptr},
    {0x72, "LONG_BINPUT", nullptr},
    {0x73, "SETITEM", nullptr},
    {0x74, "TUPLE", nullptr},
    {0x29, "EMPTY_TUPLE", nullptr},
    {0x75, "SETITEMS", nullptr},
    {0x47, "BINFLOAT", nullptr},
    {0x80, "PROTO", nullptr},
    {0x81, "NEWOBJ", k_object},
    {0x82, "EXT1", k_object},
    {0x83, "EXT2", k_object},
    {0x84, "EXT4", k_object},
    {0x85, "TUPLE1", nullptr},
    {0x86, "TUPLE2", nullptr},
    {0x87, "TUPLE3", nullptr},
    {0x88, "NEWTRUE", nullptr},
    {0x89, "NEWFALSE", nullptr},
    {0x8a, "LONG1", nullptr},
    {0x8b, "LONG4", nullptr},
    {0x42, "BINBYTES", nullptr},
    {0x43, "SHORT_BINBYTES", nullptr},
    {0x8c, "SHORT_BINUNICODE", nullptr},
    {0x8d, "BINUNICODE8", nullptr},
    {0x8e, "BINBYTES8", nullptr},
    {0x8f, "EMPTY_SET", k_not_plain},
    {0x90, "ADDITEMS", k_not_plain},
    {0x91, "FROZENSET", k_not_plain},
    {0x92, "NEWOBJ_EX", k_object},
    {0x93, "STACK_GLOBAL", k_object},
    {0x94, "MEMOIZE", nullptr},
    {0x95, "FRAME", nullptr},
    {0x96, "BYTEARRAY8", k_not_plain},
    {0x97, "NEXT_BUFFER", "an out-of-band buffer, which a file does not carry"},
    {0x98, "READONLY_BUFFER", "an out-of-band buffer, which a file does not carry"},
};

const opcode_name* find_opcode(unsigned char c) {
  for (const opcode_name& o : k_opcodes) {
    if (o.code == c) return &o;
  }
  return nullptr;
}

std::string describe(unsigned char c) {
  const opcode_name* o = find_opcode(c);
  const bool printable = c >= 0x20 && c < 0x7f;
  if (o == nullptr) return fmt::format("unknown opcode 0x{:02x}", c);
  return printable ? fmt::format("opcode {} (0x{:02x}, '{}')", o->name, c, static_cast<char>(c))
                   : fmt::format("opcode {} (0x{:02x})", o->name, c);
}

}  // namespace

class pickle_decoder {
 public:
  pickle_decoder(std::string_view data, std::string_view name) : data_(data), name_(name) {}

  pickle_document run(pickle_document doc) {
    doc_ = &doc;
    if (data_.size() >= std::numeric_limits<std::uint32_t>::max()) {
      fail(0, fmt::format("the input is too large ({} bytes; at most 4 GiB)", data_.size()));
    }
    if (data_.empty()) fail(0, "empty input (expected the PROTO opcode, 0x80)");
    if (static_cast<unsigned char>(data_[0]) != 0x80) {
      fail(0, fmt::format("not a pickle of protocol 2 or later: it starts with 0x{:02x}, not the "
                          "PROTO opcode (0x80)",
                          static_cast<unsigned char>(data_[0])));
    }
    for (;;) {
      const std::size_t at = pos_;
      if (pos_ >= data_.size()) fail(at, "truncated: the input ends before the STOP opcode");
      const auto op = static_cast<unsigned char>(data_[pos_++]);
      if (step(op, at)) break;
    }
    if (pos_ != data_.size()) {
      fail(pos_, fmt::format("{} bytes after the STOP opcode (one pickle per file)",
                             data_.size() - pos_));
    }
    return doc;
  }

 private:
  [[noreturn]] void fail(std::size_t at, std::string_view why) const {
    throw invalid_argument(fmt::format("{}: pickle: {} at byte {}", name_, why, at));
  }

  std::string_view take(std::size_t n, std::size_t at, unsigned char op) {
    if (data_.size() - pos_ < n) {
      fail(at, fmt::format("truncated: {} needs {} more bytes, {} left", describe(op), n,
                           data_.size() - pos_));
    }
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t le(std::size_t n, std::size_t at, unsigned char op) {
    const std::string_view b = take(n, at, op);
    std::uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | static_cast<unsigned char>(b[i]);
    return v;
  }

  std::uint32_t add(pickle_document::node n) {
    doc_->nodes_.push_back(std::move(n));
    return static_cast<std::uint32_t>(doc_->nodes_.size() - 1);
  }
  pickle_document::node& node_at(std::uint32_t i) { return doc_->nodes_[i]; }
  void push(std::uint32_t node) { stack_.push_back(node); }
  std::size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  std::uint32_t pop(std::size_t at, unsigned char op) {
    if (stack_.size() <= fence()) {
      fail(at, fmt::format("{} on an empty stack{}", describe(op),
                           marks_.empty() ? "" : " (nothing above the last MARK)"));
    }
    const std::uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::uint32_t top(std::size_t at, unsigned char op) const {
    if (stack_.size() <= fence()) {
      fail(at, fmt::format("{} on an empty stack{}", describe(op),
                           marks_.empty() ? "" : " (nothing above the last MARK)"));
    }
    return stack_.back();
  }
  /// The items above the innermost MARK, which is removed.
  std::vector<std::uint32_t> pop_mark(std::size_t at, unsigned char op) {
    if (marks_.empty()) fail(at, fmt::format("{} without a MARK before it", describe(op)));
    const std::size_t f = marks_.back();
    marks_.pop_back();
    std::vector<std::uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(f), stack_.end());
    stack_.resize(f);
    return items;
  }

  void string_node(kind k, std::string_view bytes) {
    pickle_document::node n;
    n.k = k;
    n.u = doc_->text_.size();
    n.len = static_cast<std::uint32_t>(bytes.size());
    doc_->text_.append(bytes);
    push(add(std::move(n)));
  }
  void int_node(bool negative, std::uint64_t magnitude, bool big = false) {
    pickle_document::node n;
    n.k = kind::integer;
    n.negative = negative && magnitude != 0;
    n.u = magnitude;
    n.big = big;
    push(add(std::move(n)));
  }
  /// LONG1 / LONG4: little-endian two's complement of `b.size()` bytes.
  void long_node(std::string_view b) {
    std::size_t n = b.size();
    const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(b[i]); };
    if (n == 0) return int_node(false, 0);
    const bool negative = (byte(n - 1) & 0x80) != 0;
    // Drop sign-extension bytes that do not change the value.
    while (n > 1 && ((byte(n - 1) == 0x00 && (byte(n - 2) & 0x80) == 0) ||
                     (byte(n - 1) == 0xff && (byte(n - 2) & 0x80) != 0))) {
      --n;
    }
    if (!negative) {
      if (n > 9 || (n == 9 && byte(8) != 0)) return int_node(false, 0, /*big=*/true);
      std::uint64_t v = 0;
      for (std::size_t i = std::min<std::size_t>(n, 8); i-- > 0;) v = (v << 8) | byte(i);
      return int_node(false, v);
    }
    if (n > 8) return int_node(true, 0, /*big=*/true);
    std::uint64_t v = ~std::uint64_t{0};  // sign-extended
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | byte(i);
    return int_node(true, ~v + 1);  // the magnitude (2^63 for INT64_MIN)
  }

  /// Whether Python could hash `key` (a dict key): scalars, and tuples of hashable items.
  bool hashable(std::uint32_t key) const {
    std::vector<std::uint32_t> todo{key};
    while (!todo.empty()) {
      const pickle_document::node& n = doc_->nodes_[todo.back()];
      todo.pop_back();
      if (n.k == kind::list || n.k == kind::dict) return false;
      if (n.k == kind::tuple) todo.insert(todo.end(), n.items.begin(), n.items.end());
    }
    return true;
  }
  void set_items(std::uint32_t dict, const std::uint32_t* kv, std::size_t count, std::size_t at,
                 unsigned char op) {
    if (node_at(dict).k != kind::dict) {
      fail(at, fmt::format("{} on a {}, not a dict", describe(op),
                           pickle_value(doc_, dict).type_name()));
    }
    for (std::size_t i = 0; i < count; i += 2) {
      if (!hashable(kv[i])) {
        fail(at, fmt::format("{}: a dict key that is a {} (unhashable in Python)", describe(op),
                             pickle_value(doc_, kv[i]).type_name()));
      }
    }
    auto& items = node_at(dict).items;
    items.insert(items.end(), kv, kv + count);
  }
  void append_items(std::uint32_t list, const std::uint32_t* v, std::size_t count,
                    std::size_t at, unsigned char op) {
    if (node_at(list).k != kind::list) {
      fail(at, fmt::format("{} on a {}, not a list", describe(op),
                           pickle_value(doc_, list).type_name()));
    }
    auto& items = node_at(list).items;
    items.insert(items.end(), v, v + count);
  }
  void tuple_of(std::vector<std::uint32_t> items) {
    pickle_document::node n;
    n.k = kind::tuple;
    n.items = std::move(items);
    push(add(std::move(n)));
  }
  void memo_put(std::uint64_t key, std::size_t at, unsigned char op) {
    memo_[key] = top(at, op);
  }
  void memo_get(std::uint64_t key, std::size_t at, unsigned char op) {
    const auto it = memo_.find(key);
    if (it == memo_.end()) fail(at, fmt::format("{} of memo {}, which was never stored", describe(op), key));
    push(it->second);
  }

  /// Runs one opcode; true at STOP.
  bool step(unsigned char op, std::size_t at) {
    switch (op) {
      case 0x80: {  // PROTO
        const auto v = static_cast<int>(le(1, at, op));
        if (at != 0) fail(at, "PROTO after the first byte");
        if (v < 2 || v > 5) fail(at, fmt::format("protocol {} (expected 2 to 5)", v));
        doc_->protocol_ = v;
        return false;
      }
      case 0x95: {  // FRAME: a length hint; the opcodes inside are read as usual
        const std::uint64_t n = le(8, at, op);
        if (n > data_.size() - pos_) {
          fail(at, fmt::format("truncated: FRAME of {} bytes, {} left", n, data_.size() - pos_));
        }
        return false;
      }
      case 0x2e: {  // STOP
        if (!marks_.empty()) fail(at, "STOP with a MARK still open");
        if (stack_.size() != 1) {
          fail(at, fmt::format("STOP with {} values on the stack (expected 1)", stack_.size()));
        }
        doc_->root_ = stack_.back();
        return true;
      }
      case 0x28:  // MARK
        marks_.push_back(stack_.size());
        return false;
      case 0x30:  // POP
        if (stack_.size() == fence() && !marks_.empty()) {
          marks_.pop_back();  // Python's POP discards a MARK on top too
        } else {
          static_cast<void>(pop(at, op));
        }
        return false;
      case 0x31:  // POP_MARK
        static_cast<void>(pop_mark(at, op));
        return false;
      case 0x32:  // DUP
        push(top(at, op));
        return false;
      case 0x4e:  // NONE
        push(add({}));
        return false;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        pickle_document::node n;
        n.k = kind::boolean;
        n.u = op == 0x88 ? 1 : 0;
        push(add(std::move(n)));
        return false;
      }
      case 0x4a: {  // BININT: signed 32-bit
        const auto v = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4, at, op)));
        int_node(v < 0, v < 0 ? static_cast<std::uint64_t>(-static_cast<std::int64_t>(v))
                              : static_cast<std::uint64_t>(v));
        return false;
      }
      case 0x4b:  // BININT1
        int_node(false, le(1, at, op));
        return false;
      case 0x4d:  // BININT2
        int_node(false, le(2, at, op));
        return false;
      case 0x8a: {  // LONG1
        const auto n = static_cast<std::size_t>(le(1, at, op));
        long_node(take(n, at, op));
        return false;
      }
      case 0x8b: {  // LONG4: signed length
        const auto n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4, at, op)));
        if (n < 0) fail(at, fmt::format("LONG4 with a negative length {}", n));
        long_node(take(static_cast<std::size_t>(n), at, op));
        return false;
      }
      case 0x47: {  // BINFLOAT: big-endian IEEE double
        const std::string_view b = take(8, at, op);
        std::uint64_t bits = 0;
        for (const char c : b) bits = (bits << 8) | static_cast<unsigned char>(c);
        pickle_document::node n;
        n.k = kind::floating;
        n.d = std::bit_cast<double>(bits);
        push(add(std::move(n)));
        return false;
      }
      // Strings and bytes: a little-endian length of 1, 4 or 8 bytes, then the data.
      case 0x8c:    // SHORT_BINUNICODE
      case 0x58:    // BINUNICODE
      case 0x8d:    // BINUNICODE8
      case 0x43:    // SHORT_BINBYTES
      case 0x42:    // BINBYTES
      case 0x8e: {  // BINBYTES8
        const bool text = op == 0x8c || op == 0x58 || op == 0x8d;
        const std::size_t width = op == 0x8c || op == 0x43 ? 1 : (op == 0x58 || op == 0x42 ? 4 : 8);
        const std::uint64_t n = le(width, at, op);
        string_node(text ? kind::string : kind::bytes, take(n, at, op));
        return false;
      }
      case 0x7d:  // EMPTY_DICT
      case 0x5d: {  // EMPTY_LIST
        pickle_document::node n;
        n.k = op == 0x7d ? kind::dict : kind::list;
        push(add(std::move(n)));
        return false;
      }
      case 0x29:  // EMPTY_TUPLE
        tuple_of({});
        return false;
      case 0x74:  // TUPLE
        tuple_of(pop_mark(at, op));
        return false;
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const std::size_t n = op - 0x84u;
        std::vector<std::uint32_t> items(n);
        for (std::size_t i = n; i-- > 0;) items[i] = pop(at, op);
        tuple_of(std::move(items));
        return false;
      }
      case 0x61: {  // APPEND
        const std::uint32_t v = pop(at, op);
        append_items(top(at, op), &v, 1, at, op);
        return false;
      }
      case 0x65: {  // APPENDS
        const std::vector<std::uint32_t> items = pop_mark(at, op);
        append_items(top(at, op), items.data(), items.size(), at, op);
        return false;
      }
      case 0x73: {  // SETITEM
        std::uint32_t kv[2];
        kv[1] = pop(at, op);
        kv[0] = pop(at, op);
        set_items(top(at, op), kv, 2, at, op);
        return false;
      }
      case 0x75: {  // SETITEMS
        const std::vector<std::uint32_t> items = pop_mark(at, op);
        if (items.size() % 2 != 0) {
          fail(at, fmt::format("SETITEMS with an odd number of items ({}) after its MARK",
                               items.size()));
        }
        set_items(top(at, op), items.data(), items.size(), at, op);
        return false;
      }
      case 0x71:  // BINPUT
        memo_put(le(1, at, op), at, op);
        return false;
      case 0x72:  // LONG_BINPUT
        memo_put(le(4, at, op), at, op);
        return false;
      case 0x94:  // MEMOIZE
        memo_put(memo_.size(), at, op);
        return false;
      case 0x68:  // BINGET
        memo_get(le(1, at, op), at, op);
        return false;
      case 0x6a:  // LONG_BINGET
        memo_get(le(4, at, op), at, op);
        return false;
      default:
        break;
    }
    const opcode_name* o = find_opcode(op);
    if (o != nullptr && o->refusal != nullptr) {
      fail(at, fmt::format("{} refused: {}; only plain data is read, and nothing is executed",
                           describe(op), o->refusal));
    }
    fail(at, fmt::format("{}: not a pickle opcode", describe(op)));
  }

  std::string_view data_;
  std::string_view name_;
  std::size_t pos_ = 0;
  pickle_document* doc_ = nullptr;
  std::vector<std::uint32_t> stack_;
  std::vector<std::size_t> marks_;  // stack sizes at each open MARK
  std::unordered_map<std::uint64_t, std::uint32_t> memo_;
};

std::string_view pickle_value::type_name() const {
  switch (type()) {
    case kind::none:
      return "NoneType";
    case kind::boolean:
      return "bool";
    case kind::integer:
      return "int";
    case kind::floating:
      return "float";
    case kind::string:
      return "str";
    case kind::bytes:
      return "bytes";
    case kind::list:
      return "list";
    case kind::tuple:
      return "tuple";
    case kind::dict:
      return "dict";
  }
  return "?";
}

pickle_value::kind pickle_value::type() const {
  return doc_ == nullptr ? kind::none : doc_->nodes_[index_].k;
}

bool pickle_value::as_bool() const {
  return type() == kind::boolean && doc_->nodes_[index_].u != 0;
}

std::optional<std::int64_t> pickle_value::as_int64() const {
  if (type() != kind::integer) return std::nullopt;
  const pickle_document::node& n = doc_->nodes_[index_];
  if (n.big) return std::nullopt;
  constexpr auto max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (!n.negative) {
    if (n.u > max) return std::nullopt;
    return static_cast<std::int64_t>(n.u);
  }
  if (n.u > max + 1) return std::nullopt;
  return n.u == max + 1 ? std::numeric_limits<std::int64_t>::min()
                        : -static_cast<std::int64_t>(n.u);
}

std::optional<std::uint64_t> pickle_value::as_uint64() const {
  if (type() != kind::integer) return std::nullopt;
  const pickle_document::node& n = doc_->nodes_[index_];
  if (n.big || n.negative) return std::nullopt;
  return n.u;
}

std::optional<double> pickle_value::as_double() const {
  if (type() == kind::floating) return doc_->nodes_[index_].d;
  if (type() != kind::integer || doc_->nodes_[index_].big) return std::nullopt;
  const pickle_document::node& n = doc_->nodes_[index_];
  const auto m = static_cast<double>(n.u);
  return n.negative ? -m : m;
}

std::string_view pickle_value::text() const {
  if (type() != kind::string && type() != kind::bytes) return {};
  const pickle_document::node& n = doc_->nodes_[index_];
  return std::string_view(doc_->text_).substr(n.u, n.len);
}

std::size_t pickle_value::size() const {
  const kind k = type();
  if (k == kind::list || k == kind::tuple) return doc_->nodes_[index_].items.size();
  if (k == kind::dict) return doc_->nodes_[index_].items.size() / 2;
  return 0;
}

pickle_value pickle_value::at(std::size_t i) const {
  return {doc_, doc_->nodes_[index_].items.at(i)};
}

pickle_value pickle_value::key_at(std::size_t i) const {
  return {doc_, doc_->nodes_[index_].items.at(2 * i)};
}

pickle_value pickle_value::value_at(std::size_t i) const {
  return {doc_, doc_->nodes_[index_].items.at(2 * i + 1)};
}

std::optional<pickle_value> pickle_value::get(std::string_view key) const {
  if (type() != kind::dict) return std::nullopt;
  const auto& items = doc_->nodes_[index_].items;
  // A key set twice keeps its last value, as in Python.
  for (std::size_t i = items.size(); i >= 2; i -= 2) {
    const pickle_value k(doc_, items[i - 2]);
    if (k.type() == kind::string && k.text() == key) return pickle_value(doc_, items[i - 1]);
  }
  return std::nullopt;
}

pickle_document parse_pickle(std::string_view data, std::string_view name) {
  return pickle_decoder(data, name).run(pickle_document{});
}

}  // namespace cucache::detail
