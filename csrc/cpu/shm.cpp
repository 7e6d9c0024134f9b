#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace pyallreduce {
namespace {

// Python sees these as RuntimeError (pybind11's translation of std::runtime_error).
[[noreturn]] void raise_errno(const char* what, const std::string& name) {
  throw std::runtime_error("pyallreduce: " + std::string(what) + " of shared-memory segment '" + name +
                           "' failed: " + std::strerror(errno));
}

void* map_fd(int fd, int64_t size, const std::string& name) {
  // MAP_POPULATE: fault every page in now, not inside the first collective.
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (addr == MAP_FAILED) {
    int saved = errno;
    close(fd);
    errno = saved;
    raise_errno("mmap", name);
  }
  close(fd);
  return addr;
}

std::string mib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", bytes / (1 << 20));
  return text;
}

// Why segment fd does not fit in the filesystem behind shm_open (/dev/shm),
// with its free and total sizes, and what to do.
std::string no_room(int fd, const std::string& name, int64_t size) {
  struct statvfs fs {};
  std::string room;
  if (fstatvfs(fd, &fs) == 0) {
    room = "; " + mib(double(fs.f_bavail) * fs.f_frsize) + " free of " + mib(double(fs.f_blocks) * fs.f_frsize);
  }
  return "pyallreduce: shared-memory segment '" + name + "' of " + mib(double(size)) +
      " does not fit in /dev/shm (" + std::strerror(ENOSPC) + room +
      "): every rank on this host needs one (two staging buffers of max_bytes, plus flags). Give /dev/shm more "
      "room (Docker: --shm-size=1g or --ipc=host) or create the Communicator with a smaller max_bytes";
}

// Creates a new zero-filled segment readable and writable by this user only,
// its pages reserved now: on tmpfs a file merely sized (ftruncate) gets its
// pages at first touch, and one that does not fit then kills the process with
// SIGBUS inside a collective (the default 64 MiB /dev/shm of a Docker
// container holds less than one default segment). O_EXCL: an existing name
// (another job's, or a guess planted by another user) is an error, never
// silently shared.
int64_t shm_create(const std::string& name, int64_t size) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
  if (fd < 0) raise_errno("create", name);
  int err = fchmod(fd, S_IRUSR | S_IWUSR) == 0 ? 0 : errno;
  if (err == 0) {
    do err = posix_fallocate(fd, 0, size);  // returns the error; errno is left alone
    while (err == EINTR);                   // tmpfs stops at a pending signal
  }
  if (err != 0) {
    shm_unlink(name.c_str());
    const std::string why = err == ENOSPC ? no_room(fd, name, size) : "";
    close(fd);
    if (!why.empty()) throw std::runtime_error(why);
    errno = err;
    raise_errno("sizing", name);
  }
  try {
    return reinterpret_cast<int64_t>(map_fd(fd, size, name));
  } catch (...) {
    shm_unlink(name.c_str());  // its pages are reserved: nobody else would free them
    throw;
  }
}

// Maps a peer's segment after checking it is ours and of the expected size.
int64_t shm_map(const std::string& name, int64_t size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) raise_errno("open", name);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    raise_errno("stat", name);
  }
  if (st.st_uid != geteuid() || st.st_size != size) {
    close(fd);
    throw std::runtime_error("pyallreduce: shared-memory segment '" + name + "' has owner uid " +
                             std::to_string(st.st_uid) + " and size " + std::to_string(st.st_size) +
                             "; expected uid " + std::to_string(geteuid()) + " and size " + std::to_string(size) +
                             " (all ranks must run as one user with the same max_bytes)");
  }
  return reinterpret_cast<int64_t>(map_fd(fd, size, name));
}

// Returns false if the name was already gone (another rank removed it first).
bool shm_remove(const std::string& name) {
  if (shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  raise_errno("unlink", name);
}

void shm_unmap(int64_t addr, int64_t size) {
  if (munmap(reinterpret_cast<void*>(addr), size) != 0) {
    throw std::runtime_error(std::string("pyallreduce: munmap failed: ") + std::strerror(errno));
  }
}

}  // namespace

void bind_shm(pybind11::module_& m) {
  using pybind11::arg;
  m.def("shm_create", &shm_create, arg("name"), arg("size"));
  m.def("shm_map", &shm_map, arg("name"), arg("size"));
  m.def("shm_remove", &shm_remove, arg("name"));
  m.def("shm_unmap", &shm_unmap, arg("addr"), arg("size"));
}

}  // namespace pyallreduce
