// Running a piece of work in a forked child process and reading its answer back: for work that
// needs process-wide state of its own -- PyTorch's allocator, which takes its settings once per
// process (the advisor, tools/replay/advisor.cpp), or cucache's process registry, which takes
// CUCACHE_CONF once (cucache-bench's observe cases).
#pragma once

#include <functional>
#include <string>

namespace cucache::tools {

/// What a child answered.
struct child_answer {
  bool ok = false;    ///< the child ran `work` to its end and exited 0
  std::string text;   ///< what `work` returned, when ok
  std::string error;  ///< why not, when !ok: the exception's message, a signal, an exit status
};

/// Forks; the child runs `work` and sends back what it returns (or the message of what it
/// throws), then leaves with _exit (no atexit handlers, no flush of the parent's buffers). The
/// parent waits for it. The child inherits a copy of the process: it must not use a CUDA context
/// the parent made (CUDA does not survive fork), so the caller keeps CUDA out of `work` or out
/// of the parent.
[[nodiscard]] child_answer run_in_child(const std::function<std::string()>& work);

}  // namespace cucache::tools
