// Keeps a process's listening sockets on loopback: a bind() to the wildcard address
// (0.0.0.0, or :: on an IPv6 socket) binds 127.0.0.1 instead (::ffff:127.0.0.1 on an IPv6
// socket: IPv4 loopback clients still reach it through a dual-stack socket; connections
// to ::1 do not). Every other bind() is passed through unchanged.
//
// Why: TensorFlow's gRPC server binds "0.0.0.0:<port>" (hard-coded in TF 2.16-2.21's
// grpc_server_lib.cc; no ServerDef, RPC option or environment variable changes it), and
// its master, worker and eager services run whatever ops a client sends. A local job's
// servers must not be reachable from other machines. tfpsx's launcher (LocalCluster,
// tfpsx-run) preloads this library into each task (LD_PRELOAD) unless told to expose the
// job. Built by setup.py with the C++ compiler alone (no TensorFlow), libdl only.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

namespace {

using BindFn = int (*)(int, const struct sockaddr*, socklen_t);

BindFn RealBind() {
  static BindFn real = reinterpret_cast<BindFn>(dlsym(RTLD_NEXT, "bind"));
  return real;
}

}  // namespace

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
    if (copy.sin_addr.s_addr == htonl(INADDR_ANY)) {
      copy.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real(fd, reinterpret_cast<const sockaddr*>(&copy), sizeof copy);
    }
  } else if (addr != nullptr && addr->sa_family == AF_INET6 &&
             len >= static_cast<socklen_t>(sizeof(sockaddr_in6))) {
    sockaddr_in6 copy;
    memcpy(&copy, addr, sizeof copy);
    if (IN6_IS_ADDR_UNSPECIFIED(&copy.sin6_addr)) {
      // ::ffff:127.0.0.1, the IPv4-mapped loopback address.
      memset(&copy.sin6_addr, 0, sizeof copy.sin6_addr);
      copy.sin6_addr.s6_addr[10] = 0xff;
      copy.sin6_addr.s6_addr[11] = 0xff;
      copy.sin6_addr.s6_addr[12] = 127;
      copy.sin6_addr.s6_addr[15] = 1;
      return real(fd, reinterpret_cast<const sockaddr*>(&copy), sizeof copy);
    }
  }
  return real(fd, addr, len);
}
