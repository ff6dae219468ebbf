// Keeps a local job's TensorFlow servers on loopback: a bind() to the wildcard address
// (0.0.0.0, or :: on an IPv6 socket) *on one of the job's ports* binds loopback instead:
// 127.0.0.1 on an IPv4 socket; ::ffff:127.0.0.1 on a dual-stack IPv6 socket (IPv4
// loopback clients still reach it; connections to ::1 do not); ::1 on an IPV6_V6ONLY
// socket (which cannot take an IPv4 address). Every other bind() is passed through
// unchanged: the user's own servers (a metrics endpoint, TensorBoard --bind_all) listen
// where they ask.
//
// The job's ports: TFPSX_LOOPBACK_PORTS (comma-separated, read once at the first bind),
// plus any a task adds at run time through tfpsx_loopback_confine_port() (a server it
// starts on a port it picked itself, e.g. the hybrid mode's dense all-reduce).
//
// Why: TensorFlow's gRPC server binds "0.0.0.0:<port>" (hard-coded in TF 2.16-2.21's
// grpc_server_lib.cc; no ServerDef, RPC option or environment variable changes it), and
// its master, worker and eager services run whatever ops a client sends. A local job's
// servers must not be reachable from other machines. tfpsx's launcher (LocalCluster,
// tfpsx-run) preloads this library into each task (LD_PRELOAD) unless told to expose the
// job, and checks what the tasks bound (tfpsx/launcher/loopback.py). Built by setup.py
// with the C++ compiler alone (no TensorFlow), libdl only.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace {

using BindFn = int (*)(int, const struct sockaddr*, socklen_t);

BindFn RealBind() {
  static BindFn real = reinterpret_cast<BindFn>(dlsym(RTLD_NEXT, "bind"));
  return real;
}

// One bit a port.
std::atomic<uint64_t> confined[65536 / 64];

void Confine(long port) {
  if (port > 0 && port < 65536)
    confined[port >> 6].fetch_or(uint64_t{1} << (port & 63), std::memory_order_relaxed);
}

void ReadEnvironment() {
  const char* list = getenv("TFPSX_LOOPBACK_PORTS");
  if (list == nullptr) return;
  while (*list != '\0') {
    char* end = nullptr;
    const long port = strtol(list, &end, 10);
    if (end == list) {  // not a number: skip to the next comma
      while (*list != '\0' && *list != ',') ++list;
    } else {
      Confine(port);
      list = end;
    }
    while (*list == ',' || *list == ' ') ++list;
  }
}

bool IsConfined(uint16_t port_net) {
  static std::once_flag once;
  std::call_once(once, ReadEnvironment);
  const unsigned port = ntohs(port_net);
  return port != 0 &&
         (confined[port >> 6].load(std::memory_order_relaxed) >> (port & 63) & 1) != 0;
}

}  // namespace

// Adds a port whose wildcard binds go to loopback in this process from now on.
extern "C" __attribute__((visibility("default"))) void tfpsx_loopback_confine_port(int port) {
  Confine(port);
}

extern "C" int bind(int fd, const struct sockaddr* addr, socklen_t len) {
  BindFn real = RealBind();
  if (real == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  if (addr != nullptr && addr->sa_family == AF_INET &&
      len >= static_cast<socklen_t>(sizeof(sockaddr_in))) {
    sockaddr_in copy;
    memcpy(&copy, addr, sizeof copy);
    if (copy.sin_addr.s_addr == htonl(INADDR_ANY) && IsConfined(copy.sin_port)) {
      copy.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real(fd, reinterpret_cast<const sockaddr*>(&copy), sizeof copy);
    }
  } else if (addr != nullptr && addr->sa_family == AF_INET6 &&
             len >= static_cast<socklen_t>(sizeof(sockaddr_in6))) {
    sockaddr_in6 copy;
    memcpy(&copy, addr, sizeof copy);
    if (IN6_IS_ADDR_UNSPECIFIED(&copy.sin6_addr) && IsConfined(copy.sin6_port)) {
      int v6only = 0;
      socklen_t size = sizeof v6only;
      if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size) != 0) v6only = 0;
      if (v6only) {
        copy.sin6_addr = in6addr_loopback;  // ::1: an IPv6-only socket takes no IPv4
      } else {
        // ::ffff:127.0.0.1, the IPv4-mapped loopback address.
        memset(&copy.sin6_addr, 0, sizeof copy.sin6_addr);
        copy.sin6_addr.s6_addr[10] = 0xff;
        copy.sin6_addr.s6_addr[11] = 0xff;
        copy.sin6_addr.s6_addr[12] = 127;
        copy.sin6_addr.s6_addr[15] = 1;
      }
      return real(fd, reinterpret_cast<const sockaddr*>(&copy), sizeof copy);
    }
  }
  return real(fd, addr, len);
}
