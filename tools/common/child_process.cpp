#include "common/child_process.hpp"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>

namespace cucache::tools {
namespace {

/// Writes all of `text`; false when the pipe refuses it.
bool write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      return false;
    }
  }
  return true;
}

}  // namespace

child_answer run_in_child(const std::function<std::string()>& work) {
  child_answer answer;
  int fds[2];
  if (::pipe(fds) != 0) {
    answer.error = fmt::format("pipe: {}", std::strerror(errno));
    return answer;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    answer.error = fmt::format("fork: {}", std::strerror(errno));
    ::close(fds[0]);
    ::close(fds[1]);
    return answer;
  }
  if (pid == 0) {  // the child: the first byte says whether `work` returned (+) or threw (-)
    ::close(fds[0]);
    std::string message;
    try {
      message = "+" + work();
    } catch (const std::exception& e) {
      message = std::string("-") + e.what();
    } catch (...) {
      message = "-an exception that is not a std::exception";
    }
    ::_exit(write_all(fds[1], message) ? 0 : 3);
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      text.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    answer.error = fmt::format("the child process died of signal {} ({})", WTERMSIG(status),
                               strsignal(WTERMSIG(status)));
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    answer.error = fmt::format("the child process exited with status {}", WEXITSTATUS(status));
  } else if (text.empty()) {
    answer.error = "the child process answered nothing";
  } else if (text.front() == '-') {
    answer.error = text.substr(1);
  } else {
    answer.ok = true;
    answer.text = text.substr(1);
  }
  return answer;
}

}  // namespace cucache::tools
