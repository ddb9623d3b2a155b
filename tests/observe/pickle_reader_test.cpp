// Tests of the strict plain-data pickle decoder (src/observe/pickle_reader.hpp): pickles written by
// python3's own pickle module (protocols 2, 4, 5; the bytes below are its output, as the comments
// say) decode to exactly the values pickled; every refused opcode, truncation and stack error is
// named with its byte offset; and random mutations of a valid pickle either decode or throw
// invalid_argument, never anything else.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>

#include "cucache/errors.hpp"
#include "observe/pickle_reader.hpp"

namespace cucache::detail {
namespace {

// The value pickled (python3):
//   shared = {"filename": "a.py", "line": 3, "name": "f"}
//   value = {"ints": [0, 1, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31, 2**63 - 1,
//                     2**63, 2**64 - 1, -2**63, 2**64, -2**63 - 1],
//            "f": 1.5, "s": "h\u00e9llo", "t": (1, "x"), "n": None, "yes": True, "no": False,
//            "shared": [shared, shared], "empty": {}, "long": "y" * 300}
//   and, for protocols 4 and 5, value["b"] = b"\x00\x01" (protocol 2 pickles bytes through
//   GLOBAL _codecs.encode, which the decoder refuses: see k_proto2_bytes_hex).
// python3: pickle.dumps(value, protocol=2)
constexpr std::string_view k_proto2_hex =
    "80027d7100285804000000696e747371015d7102284b004b014bff4d00014dffff4a000001004affffffff4a00000080"
    "4affffff7f8a0500000080008a08ffffffffffffff7f8a090000000000000080008a09ffffffffffffffff008a080000"
    "0000000000808a090000000000000000018a09ffffffffffffff7fff655801000000667103473ff80000000000005801"
    "000000737104580600000068c3a96c6c6f710558010000007471064b01580100000078710786710858010000006e7109"
    "4e5803000000796573710a8858020000006e6f710b895806000000736861726564710c5d710d287d710e285808000000"
    "66696c656e616d65710f5804000000612e7079711058040000006c696e6571114b0358040000006e616d657112680375"
    "680e655805000000656d70747971137d711458040000006c6f6e677115582c0100007979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797116"
    "752e"
    ;
// python3: pickle.dumps(value, protocol=4)
constexpr std::string_view k_proto4_hex =
    "80049532020000000000007d94288c04696e7473945d94284b004b014bff4d00014dffff4a000001004affffffff4a00"
    "0000804affffff7f8a0500000080008a08ffffffffffffff7f8a090000000000000080008a09ffffffffffffffff008a"
    "0800000000000000808a090000000000000000018a09ffffffffffffff7fff658c016694473ff80000000000008c0173"
    "948c0668c3a96c6c6f948c0174944b018c01789486948c016e944e8c0379657394888c026e6f94898c06736861726564"
    "945d94287d94288c0866696c656e616d65948c04612e7079948c046c696e65944b038c046e616d6594680375680e658c"
    "05656d707479947d948c046c6f6e6794582c010000797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979797979"
    "797979797979797979797979797979797979797979797979797979797979797979948c0162944302000194752e"
    ;
// python3: pickle.dumps({'b': b'\x00'}, protocol=2): bytes through GLOBAL _codecs.encode + REDUCE
constexpr std::string_view k_proto2_bytes_hex = "80027d71005801000000627101635f636f646563730a656e636f64650a7102580100000000710358060000006c6174696e317104867105527106732e";
// 13

std::string unhex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16));
  }
  return out;
}

std::string rejection(std::string_view data) {
  try {
    (void)parse_pickle(data, "t.pickle");
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return {};
}

using kind = pickle_value::kind;

void check_value(const pickle_document& doc, bool with_bytes) {
  const pickle_value root = doc.root();
  ASSERT_TRUE(root.is(kind::dict));
  EXPECT_EQ(root.size(), with_bytes ? 11U : 10U);
  const auto ints = root.get("ints");
  ASSERT_TRUE(ints.has_value());
  ASSERT_TRUE(ints->is(kind::list));
  ASSERT_EQ(ints->size(), 16U);
  constexpr std::int64_t i64min = std::numeric_limits<std::int64_t>::min();
  const std::int64_t expect_signed[] = {0,        1,          255,          256,
                                        65535,    65536,      -1,           -2147483648LL,
                                        2147483647LL, 2147483648LL, std::numeric_limits<std::int64_t>::max()};
  for (std::size_t i = 0; i < std::size(expect_signed); ++i) {
    EXPECT_EQ(ints->at(i).as_int64(), expect_signed[i]) << i;
  }
  EXPECT_EQ(ints->at(11).as_int64(), std::nullopt);  // 2**63
  EXPECT_EQ(ints->at(11).as_uint64(), std::uint64_t{1} << 63);
  EXPECT_EQ(ints->at(12).as_uint64(), std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(ints->at(13).as_int64(), i64min);
  EXPECT_EQ(ints->at(13).as_uint64(), std::nullopt);  // negative
  EXPECT_TRUE(ints->at(14).is(kind::integer));        // 2**64: an int, beyond 64 bits
  EXPECT_EQ(ints->at(14).as_uint64(), std::nullopt);
  EXPECT_EQ(ints->at(15).as_int64(), std::nullopt);   // -2**63 - 1
  EXPECT_EQ(ints->at(6).as_uint64(), std::nullopt);   // -1
  EXPECT_EQ(root.get("f")->as_double(), 1.5);
  EXPECT_EQ(root.get("s")->text(), "h\xc3\xa9llo");
  const pickle_value t = *root.get("t");
  ASSERT_TRUE(t.is(kind::tuple));
  ASSERT_EQ(t.size(), 2U);
  EXPECT_EQ(t.at(0).as_int64(), 1);
  EXPECT_EQ(t.at(1).text(), "x");
  EXPECT_TRUE(root.get("n")->is(kind::none));
  EXPECT_TRUE(root.get("yes")->as_bool());
  EXPECT_TRUE(root.get("no")->is(kind::boolean));
  EXPECT_FALSE(root.get("no")->as_bool());
  const pickle_value shared = *root.get("shared");
  ASSERT_EQ(shared.size(), 2U);
  // The memo: both items are the one dict, stored once.
  EXPECT_EQ(shared.at(0).index(), shared.at(1).index());
  EXPECT_EQ(shared.at(0).get("filename")->text(), "a.py");
  EXPECT_EQ(shared.at(1).get("line")->as_int64(), 3);
  EXPECT_EQ(shared.at(1).get("name")->text(), "f");
  EXPECT_TRUE(root.get("empty")->is(kind::dict));
  EXPECT_EQ(root.get("empty")->size(), 0U);
  EXPECT_EQ(root.get("long")->text(), std::string(300, 'y'));
  if (with_bytes) {
    EXPECT_TRUE(root.get("b")->is(kind::bytes));
    EXPECT_EQ(root.get("b")->text(), std::string("\x00\x01", 2));
  }
  EXPECT_EQ(root.get("missing"), std::nullopt);
  EXPECT_EQ(root.key_at(0).text(), "ints");
}

TEST(PickleReader, DecodesPythonsProtocols2To5) {
  const auto p2 = parse_pickle(unhex(k_proto2_hex), "p2");
  EXPECT_EQ(p2.protocol(), 2);
  check_value(p2, false);
  const auto p4 = parse_pickle(unhex(k_proto4_hex), "p4");
  EXPECT_EQ(p4.protocol(), 4);
  check_value(p4, true);
  // python3's pickle.dumps(value, protocol=5) is protocol 4's bytes with 5 in the PROTO opcode
  // (checked with python3 3.11: nothing in `value` needs protocol 5's out-of-band buffers).
  std::string proto5 = unhex(k_proto4_hex);
  proto5[1] = '\x05';
  const auto p5 = parse_pickle(proto5, "p5");
  EXPECT_EQ(p5.protocol(), 5);
  check_value(p5, true);
}

TEST(PickleReader, RefusesObjectsNamingTheOpcodeAndOffset) {
  EXPECT_EQ(rejection(unhex(k_proto2_bytes_hex)),
            "t.pickle: pickle: opcode GLOBAL (0x63, 'c') refused: it names or builds a Python "
            "object; only plain data is read, and nothing is executed at byte 13");
  // STACK_GLOBAL, REDUCE, BUILD, NEWOBJ after a valid start.
  for (const auto& [byte, name] : std::initializer_list<std::pair<char, std::string_view>>{
           {'\x93', "STACK_GLOBAL (0x93)"}, {'R', "REDUCE (0x52, 'R')"}, {'b', "BUILD (0x62, 'b')"},
           {'\x81', "NEWOBJ (0x81)"}, {'\x8f', "EMPTY_SET (0x8f)"}, {'I', "INT (0x49, 'I')"}}) {
    const std::string msg = rejection(std::string("\x80\x04", 2) + byte);
    EXPECT_NE(msg.find(std::string("opcode ") + std::string(name) + " refused"), std::string::npos)
        << msg;
    EXPECT_TRUE(msg.ends_with(" at byte 2")) << msg;
  }
  EXPECT_EQ(rejection(std::string("\x80\x04\x01", 3)),
            "t.pickle: pickle: unknown opcode 0x01: not a pickle opcode at byte 2");
}

TEST(PickleReader, RefusesMalformedInputWithItsOffset) {
  const std::string p4 = unhex(k_proto4_hex);
  // Truncated anywhere: a clear error, never a partial value.
  for (std::size_t n = 0; n < p4.size(); ++n) {
    const std::string msg = rejection(std::string_view(p4).substr(0, n));
    EXPECT_NE(msg.find("t.pickle: pickle: "), std::string::npos) << n << ": " << msg;
  }
  // Protocol 4 frames its opcodes: a cut frame is named as such; protocol 2 has no frames.
  EXPECT_EQ(rejection(p4.substr(0, p4.size() - 1)),
            fmt::format("t.pickle: pickle: truncated: FRAME of {} bytes, {} left at byte 2",
                        p4.size() - 11, p4.size() - 12));
  const std::string p2 = unhex(k_proto2_hex);
  EXPECT_EQ(rejection(p2.substr(0, p2.size() - 1)),
            fmt::format("t.pickle: pickle: truncated: the input ends before the STOP opcode at "
                        "byte {}",
                        p2.size() - 1));
  EXPECT_EQ(rejection(""), "t.pickle: pickle: empty input (expected the PROTO opcode, 0x80) at byte 0");
  EXPECT_EQ(rejection("{\"a\": 1}"),
            "t.pickle: pickle: not a pickle of protocol 2 or later: it starts with 0x7b, not the "
            "PROTO opcode (0x80) at byte 0");
  EXPECT_EQ(rejection(std::string("\x80\x01N.", 4)),
            "t.pickle: pickle: protocol 1 (expected 2 to 5) at byte 0");
  EXPECT_EQ(rejection(std::string("\x80\x04N.x", 5)),
            "t.pickle: pickle: 1 bytes after the STOP opcode (one pickle per file) at byte 4");
  EXPECT_EQ(rejection(std::string("\x80\x04.", 3)),
            "t.pickle: pickle: STOP with 0 values on the stack (expected 1) at byte 2");
  EXPECT_EQ(rejection(std::string("\x80\x04NN.", 5)),
            "t.pickle: pickle: STOP with 2 values on the stack (expected 1) at byte 4");
  EXPECT_EQ(rejection(std::string("\x80\x04(N.", 5)),
            "t.pickle: pickle: STOP with a MARK still open at byte 4");
  EXPECT_EQ(rejection(std::string("\x80\x04h\x05.", 5)),
            "t.pickle: pickle: opcode BINGET (0x68, 'h') of memo 5, which was never stored at "
            "byte 2");
  EXPECT_EQ(rejection(std::string("\x80\x04" "a", 3)),
            "t.pickle: pickle: opcode APPEND (0x61, 'a') on an empty stack at byte 2");
  EXPECT_EQ(rejection(std::string("\x80\x04]Ne.", 6)),
            "t.pickle: pickle: opcode APPENDS (0x65, 'e') without a MARK before it at byte 4");
  EXPECT_EQ(rejection(std::string("\x80\x04NNa.", 6)),
            "t.pickle: pickle: opcode APPEND (0x61, 'a') on a NoneType, not a list at byte 4");
  EXPECT_EQ(rejection(std::string("\x80\x04NNNs.", 7)),
            "t.pickle: pickle: opcode SETITEM (0x73, 's') on a NoneType, not a dict at byte 5");
  EXPECT_EQ(rejection(std::string("\x80\x04}]Ns.", 7)),
            "t.pickle: pickle: opcode SETITEM (0x73, 's'): a dict key that is a list "
            "(unhashable in Python) at byte 5");
  EXPECT_EQ(rejection(std::string("\x80\x04}(]Nu.", 8)),
            "t.pickle: pickle: opcode SETITEMS (0x75, 'u'): a dict key that is a list "
            "(unhashable in Python) at byte 6");
  EXPECT_EQ(rejection(std::string("\x80\x04}(Nu.", 7)),
            "t.pickle: pickle: SETITEMS with an odd number of items (1) after its MARK at byte 5");
  EXPECT_EQ(rejection(std::string("\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00N.", 13)),
            "t.pickle: pickle: truncated: FRAME of 16 bytes, 2 left at byte 2");
  EXPECT_EQ(rejection(std::string("\x80\x04\x8c\x05" "ab", 6)),
            "t.pickle: pickle: truncated: opcode SHORT_BINUNICODE (0x8c) needs 5 more bytes, 2 "
            "left at byte 2");
  // A MARK fences the stack: APPEND cannot reach the list below it.
  EXPECT_EQ(rejection(std::string("\x80\x04](a.", 6)),
            "t.pickle: pickle: opcode APPEND (0x61, 'a') on an empty stack (nothing above the last "
            "MARK) at byte 4");
}

TEST(PickleReader, HandMadeOpcodesDecode) {
  // PROTO 4, MARK, 1, 2, TUPLE, DUP, POP, MEMOIZE, POP, BINGET 0, EMPTY_LIST, MARK, NEWTRUE,
  // NEWFALSE, APPENDS, TUPLE2, STOP: ((1, 2), [True, False]).
  const auto doc =
      parse_pickle(std::string("\x80\x04(K\x01K\x02t20\x94" "0h\x00](\x88\x89" "e\x86.", 21), "h");
  const pickle_value r = doc.root();
  ASSERT_TRUE(r.is(kind::tuple));
  ASSERT_EQ(r.size(), 2U);
  EXPECT_EQ(r.at(0).size(), 2U);
  EXPECT_EQ(r.at(0).at(1).as_int64(), 2);
  EXPECT_TRUE(r.at(1).at(0).as_bool());
  EXPECT_FALSE(r.at(1).at(1).as_bool());
  // A key set twice keeps its last value (as in Python); LONG1 of zero length is 0.
  const auto d = parse_pickle(std::string("\x80\x04}(\x8c\x01" "aK\x01\x8c\x01" "a\x8a\x00u.", 16), "d");
  EXPECT_EQ(d.root().get("a")->as_int64(), 0);
  // A list holding itself decodes (the reader of a document walks it to a bounded depth).
  const auto self = parse_pickle(std::string("\x80\x04]\x94h\x00" "a.", 8), "s");
  EXPECT_EQ(self.root().at(0).index(), self.root().index());
}

TEST(PickleReader, MutatedPicklesDecodeOrThrowInvalidArgument) {
  const std::string base = unhex(k_proto4_hex);
  std::mt19937_64 rng(35);
  std::size_t decoded = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % s.size();
      switch (rng() % 3) {
        case 0:
          s[at] = static_cast<char>(rng());
          break;
        case 1:
          s.erase(at, 1 + rng() % 8);
          break;
        default:
          s.insert(at, 1, static_cast<char>(rng()));
          break;
      }
      if (s.empty()) s.push_back(static_cast<char>(0x80));
    }
    try {
      const pickle_document doc = parse_pickle(s, "m");
      ++decoded;
      EXPECT_LE(doc.nodes(), s.size());  // at most one node per input byte
    } catch (const invalid_argument& e) {
      EXPECT_TRUE(std::string_view(e.what()).starts_with("m: pickle: ")) << e.what();
    }
  }
  EXPECT_GT(decoded, 0U);  // some mutations (in a string's bytes) still decode
}

}  // namespace
}  // namespace cucache::detail
