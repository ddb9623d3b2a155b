// The lock rules as clang thread-safety annotations (docs/decisions/0018-thread-safety-annotations.md):
// the macros, and annotated mutexes and scoped locks to use them with. clang checks them under
// -Wthread-safety (tools/check_thread_safety.sh, CI job "tsa"); other compilers see nothing.
//
// In the backend layer, the lowest one with a lock (sim_backend's export table), so that every
// layer above can use it.
#pragma once

#include <mutex>
#include <shared_mutex>
#include <utility>

#if defined(__clang__)
#define CUCACHE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define CUCACHE_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) CUCACHE_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY CUCACHE_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) CUCACHE_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) CUCACHE_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) CUCACHE_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) CUCACHE_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) CUCACHE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) CUCACHE_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) CUCACHE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) CUCACHE_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) CUCACHE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) CUCACHE_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) CUCACHE_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) CUCACHE_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TRY_ACQUIRE_SHARED(...) \
  CUCACHE_THREAD_ANNOTATION(try_acquire_shared_capability(__VA_ARGS__))
#define EXCLUDES(...) CUCACHE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) CUCACHE_THREAD_ANNOTATION(assert_capability(x))
#define ASSERT_SHARED_CAPABILITY(x) CUCACHE_THREAD_ANNOTATION(assert_shared_capability(x))
#define RETURN_CAPABILITY(x) CUCACHE_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS CUCACHE_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace cucache::detail {

/// std::mutex as a capability. constexpr-constructible, like std::mutex (constinit globals).
class CAPABILITY("mutex") mutex {
 public:
  constexpr mutex() noexcept = default;
  mutex(const mutex&) = delete;
  mutex& operator=(const mutex&) = delete;
  void lock() ACQUIRE() { m_.lock(); }
  bool try_lock() TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() RELEASE() { m_.unlock(); }
  /// Tells the analysis that the caller holds this mutex (a rule it cannot follow); checks
  /// nothing at run time.
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  std::mutex m_;
};

/// std::shared_mutex as a capability.
class CAPABILITY("mutex") shared_mutex {
 public:
  shared_mutex() = default;
  shared_mutex(const shared_mutex&) = delete;
  shared_mutex& operator=(const shared_mutex&) = delete;
  void lock() ACQUIRE() { m_.lock(); }
  bool try_lock() TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() RELEASE() { m_.unlock(); }
  void lock_shared() ACQUIRE_SHARED() { m_.lock_shared(); }
  bool try_lock_shared() TRY_ACQUIRE_SHARED(true) { return m_.try_lock_shared(); }
  void unlock_shared() RELEASE_SHARED() { m_.unlock_shared(); }
  void assert_held() const ASSERT_CAPABILITY(this) {}
  void assert_held_shared() const ASSERT_SHARED_CAPABILITY(this) {}

 private:
  std::shared_mutex m_;
};

/// std::lock_guard for an annotated mutex: held from construction to destruction.
template <class M>
class SCOPED_CAPABILITY lock_guard {
 public:
  explicit lock_guard(M& m) ACQUIRE(m) : m_(m) { m_.lock(); }
  /// Adopts a lock the caller took.
  lock_guard(M& m, std::adopt_lock_t) noexcept REQUIRES(m) : m_(m) {}
  ~lock_guard() RELEASE() { m_.unlock(); }
  lock_guard(const lock_guard&) = delete;
  lock_guard& operator=(const lock_guard&) = delete;

 private:
  M& m_;
};

// The scoped locks below are the analysis's primitives: their annotations say what they hold;
// their bodies, which hold a lock conditionally (owns_), are not analysed.

/// std::unique_lock for an annotated mutex: lock() and unlock() between construction and
/// destruction are followed by the analysis. A lock handed to another function by reference is
/// not (clang cannot follow a scoped lock through a parameter): there, unlock(m) and lock(m)
/// name the mutex, so that the callee's REQUIRES(m) stays checked across them.
template <class M>
class SCOPED_CAPABILITY unique_lock {
 public:
  unique_lock() noexcept = default;
  explicit unique_lock(M& m) ACQUIRE(m) NO_THREAD_SAFETY_ANALYSIS : m_(&m), owns_(true) {
    m.lock();
  }
  unique_lock(M& m, std::defer_lock_t) noexcept EXCLUDES(m) : m_(&m) {}
  /// Adopts a lock the caller took (try_lock, or a lock taken in another scope).
  unique_lock(M& m, std::adopt_lock_t) noexcept REQUIRES(m) : m_(&m), owns_(true) {}
  unique_lock(unique_lock&& o) noexcept
      : m_(std::exchange(o.m_, nullptr)), owns_(std::exchange(o.owns_, false)) {}
  unique_lock& operator=(unique_lock&& o) noexcept NO_THREAD_SAFETY_ANALYSIS {
    if (this != &o) {
      if (owns_) m_->unlock();
      m_ = std::exchange(o.m_, nullptr);
      owns_ = std::exchange(o.owns_, false);
    }
    return *this;
  }
  ~unique_lock() RELEASE() NO_THREAD_SAFETY_ANALYSIS {
    if (owns_) m_->unlock();
  }
  unique_lock(const unique_lock&) = delete;
  unique_lock& operator=(const unique_lock&) = delete;

  void lock() ACQUIRE() NO_THREAD_SAFETY_ANALYSIS {
    m_->lock();
    owns_ = true;
  }
  void unlock() RELEASE() NO_THREAD_SAFETY_ANALYSIS {
    m_->unlock();
    owns_ = false;
  }
  /// unlock() and lock() for a function given this lock by reference: `m` is the mutex held.
  void unlock(M& m) RELEASE(m) NO_THREAD_SAFETY_ANALYSIS {
    (void)m;
    unlock();
  }
  void lock(M& m) ACQUIRE(m) NO_THREAD_SAFETY_ANALYSIS {
    (void)m;
    lock();
  }
  [[nodiscard]] bool owns_lock() const noexcept { return owns_; }
  explicit operator bool() const noexcept { return owns_; }
  [[nodiscard]] M* mutex() const noexcept { return m_; }

 private:
  M* m_ = nullptr;
  bool owns_ = false;
};

/// std::shared_lock for an annotated shared mutex.
template <class M>
class SCOPED_CAPABILITY shared_lock {
 public:
  shared_lock() noexcept = default;
  explicit shared_lock(M& m) ACQUIRE_SHARED(m) NO_THREAD_SAFETY_ANALYSIS : m_(&m), owns_(true) {
    m.lock_shared();
  }
  shared_lock(M& m, std::adopt_lock_t) noexcept REQUIRES_SHARED(m) : m_(&m), owns_(true) {}
  shared_lock(shared_lock&& o) noexcept
      : m_(std::exchange(o.m_, nullptr)), owns_(std::exchange(o.owns_, false)) {}
  shared_lock& operator=(shared_lock&& o) noexcept NO_THREAD_SAFETY_ANALYSIS {
    if (this != &o) {
      if (owns_) m_->unlock_shared();
      m_ = std::exchange(o.m_, nullptr);
      owns_ = std::exchange(o.owns_, false);
    }
    return *this;
  }
  ~shared_lock() RELEASE_GENERIC() NO_THREAD_SAFETY_ANALYSIS {
    if (owns_) m_->unlock_shared();
  }
  shared_lock(const shared_lock&) = delete;
  shared_lock& operator=(const shared_lock&) = delete;
  void lock() ACQUIRE_SHARED() NO_THREAD_SAFETY_ANALYSIS {
    m_->lock_shared();
    owns_ = true;
  }
  void unlock() RELEASE_GENERIC() NO_THREAD_SAFETY_ANALYSIS {
    m_->unlock_shared();
    owns_ = false;
  }
  [[nodiscard]] bool owns_lock() const noexcept { return owns_; }

 private:
  M* m_ = nullptr;
  bool owns_ = false;
};

}  // namespace cucache::detail
