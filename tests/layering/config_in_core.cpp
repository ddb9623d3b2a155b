// Must link against the core layer alone (and the backend below it): the configuration and its
// parser live in the lowest layer that uses them (size_policy), so nothing here needs the
// allocator, observe or api layers. If parse_config, to_string or config_from_env move back above
// the core (src/api/config.cpp, where they were), this program no longer links and the ctest
// layering_config_in_core fails.
#include "core/size_policy.hpp"
#include "cucache/config.hpp"

int main() {
  const cucache::config cfg = cucache::parse_config("max_split_size_mb:128");
  const cucache::detail::size_policy policy(cfg);
  const bool round_trips = cucache::parse_config(cucache::to_string(cfg)) == cfg;
  static_cast<void>(cucache::config_from_env());
  return round_trips && sizeof(policy) > 0 ? 0 : 1;
}
