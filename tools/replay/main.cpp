// cucache-replay: replays allocation traces through cucache (and peers on a GPU); see
// replay_engine.hpp and `cucache-replay --help`.
#include <iostream>

#include "replay_engine.hpp"

int main(int argc, char** argv) {
  return cucache::replay::run_cli(argc, argv, std::cout, std::cerr);
}
