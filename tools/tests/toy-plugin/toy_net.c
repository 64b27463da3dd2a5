/* A small NCCL net plugin that is not ours, for the tools' tests: ncclNet_v8 ("toy") over
 * TCP on loopback, one device, one buffer per receive, messages in posting order (tags are
 * not matched). Like NCCL's IB transport it sends only into a posted receive: each irecv
 * sends the sender a one-byte credit, and an isend without one returns no request. It logs the way other plugins do, with printf formats and arguments
 * (%d, %s, %p, ...), so the tests see whether the tools' logger formats them. Not for
 * production: connect blocks (on loopback it returns at once) and errors are blunt. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "nccl_net.h"

#define TOY_QUEUE 64

static ncclDebugLogger_t toy_log;

#define TOY_INFO(fmt, ...) \
  toy_log(NCCL_LOG_INFO, NCCL_NET, __FILE__, __LINE__, "toy: " fmt, __VA_ARGS__)
#define TOY_WARN(fmt, ...) \
  toy_log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "toy: " fmt, __VA_ARGS__)

struct toy_request {
  struct toy_comm *comm;
  char *buf;
  int size;  /* sender: the message's size; receiver: the buffer's, then the message's */
  int moved; /* bytes of header and payload moved so far */
  uint32_t header;
  int done;
  int failed;
};

struct toy_comm {
  int fd;
  int sender;
  struct toy_request *queue[TOY_QUEUE]; /* posted, not yet done, in order */
  int head, count;
  int credits; /* sender: receives posted by the peer and not yet used */
};

struct toy_listen {
  int fd;
};

static ncclResult_t toy_init(ncclDebugLogger_t log) {
  toy_log = log;
  TOY_WARN("a test plugin (pid %d, logger %p): not for production, %s", (int)getpid(),
           (void *)log, "loopback only");
  return ncclSuccess;
}

static ncclResult_t toy_devices(int *ndev) {
  *ndev = 1;
  return ncclSuccess;
}

static ncclResult_t toy_properties(int dev, ncclNetProperties_v8_t *props) {
  if (dev != 0) return ncclInvalidUsage;
  memset(props, 0, sizeof *props);
  props->name = "toy0";
  props->guid = 0x70;
  props->ptrSupport = NCCL_PTR_HOST;
  props->speed = 10000;
  props->port = 1;
  props->maxComms = 65536;
  props->maxRecvs = 1;
  props->netDeviceType = NCCL_NET_DEVICE_HOST;
  return ncclSuccess;
}

static ncclResult_t toy_listen(int dev, void *handle, void **listen_comm) {
  (void)dev;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    TOY_WARN("listen failed: %s (errno %d)", strerror(errno), errno);
    if (fd >= 0) close(fd);
    return ncclSystemError;
  }
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &a, sizeof a);
  struct toy_listen *l = calloc(1, sizeof *l);
  l->fd = fd;
  *listen_comm = l;
  TOY_INFO("listening on port %u (fd %d, comm %p)", (unsigned)ntohs(a.sin_port), fd, (void *)l);
  return ncclSuccess;
}

static struct toy_comm *toy_comm(int fd, int sender) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  struct toy_comm *c = calloc(1, sizeof *c);
  c->fd = fd;
  c->sender = sender;
  return c;
}

static ncclResult_t toy_connect(int dev, void *handle, void **send_comm,
                                ncclNetDeviceHandle_v8_t **dev_comm) {
  (void)dev;
  struct sockaddr_in a;
  memcpy(&a, handle, sizeof a);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    TOY_WARN("connect to port %u failed: %s", (unsigned)ntohs(a.sin_port), strerror(errno));
    if (fd >= 0) close(fd);
    return ncclSystemError;
  }
  *send_comm = toy_comm(fd, 1);
  if (dev_comm != NULL) *dev_comm = NULL;
  TOY_INFO("connected to port %u: comm %p", (unsigned)ntohs(a.sin_port), *send_comm);
  return ncclSuccess;
}

static ncclResult_t toy_accept(void *listen_comm, void **recv_comm,
                               ncclNetDeviceHandle_v8_t **dev_comm) {
  struct toy_listen *l = listen_comm;
  if (dev_comm != NULL) *dev_comm = NULL;
  int fd = accept(l->fd, NULL, NULL);
  if (fd < 0) {
    *recv_comm = NULL;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return ncclSuccess;
    TOY_WARN("accept failed: %s", strerror(errno));
    return ncclSystemError;
  }
  *recv_comm = toy_comm(fd, 0);
  TOY_INFO("accepted: comm %p (fd %d)", *recv_comm, fd);
  return ncclSuccess;
}

static ncclResult_t toy_reg(void *comm, void *data, size_t size, int type, void **mhandle) {
  (void)comm, (void)data, (void)size;
  if (type != NCCL_PTR_HOST) return ncclInvalidUsage;
  *mhandle = (void *)0x1;
  return ncclSuccess;
}

static ncclResult_t toy_dereg(void *comm, void *mhandle) {
  (void)comm, (void)mhandle;
  return ncclSuccess;
}

static ncclResult_t toy_post(struct toy_comm *c, char *buf, int size, void **request) {
  if (c->count == TOY_QUEUE) {
    *request = NULL; /* full: NCCL tries again */
    return ncclSuccess;
  }
  struct toy_request *r = calloc(1, sizeof *r);
  r->comm = c;
  r->buf = buf;
  r->size = size;
  r->header = (uint32_t)size;
  c->queue[(c->head + c->count++) % TOY_QUEUE] = r;
  *request = r;
  return ncclSuccess;
}

static ncclResult_t toy_isend(void *send_comm, void *data, int size, int tag, void *mhandle,
                              void **request) {
  (void)tag, (void)mhandle;
  struct toy_comm *c = send_comm;
  if (c->credits == 0) {
    char got[TOY_QUEUE];
    ssize_t k = recv(c->fd, got, sizeof got, 0);
    if (k > 0) c->credits += (int)k;
  }
  if (c->credits == 0) {
    *request = NULL; /* no receive posted yet: NCCL tries again */
    return ncclSuccess;
  }
  ncclResult_t r = toy_post(c, data, size, request);
  if (*request != NULL) c->credits--;
  return r;
}

static ncclResult_t toy_irecv(void *recv_comm, int n, void **data, int *sizes, int *tags,
                              void **mhandles, void **request) {
  (void)tags, (void)mhandles;
  if (n != 1) return ncclInvalidUsage;
  struct toy_comm *c = recv_comm;
  ncclResult_t r = toy_post(c, data[0], sizes[0], request);
  if (*request != NULL && send(c->fd, "c", 1, MSG_NOSIGNAL) != 1) {
    TOY_WARN("credit to the sender on comm %p failed: %s", (void *)c, strerror(errno));
    return ncclSystemError;
  }
  return r;
}

static ncclResult_t toy_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                               void **request) {
  (void)recv_comm, (void)n, (void)data, (void)sizes, (void)mhandles;
  *request = NULL;
  return ncclSuccess;
}

/* Moves bytes of the oldest request, the 4-byte header first; 1: it is done, 0: not yet,
 * -1: failed. */
static int toy_move(struct toy_comm *c, struct toy_request *r) {
  while (1) {
    int in_header = r->moved < 4;
    char *p = in_header ? (char *)&r->header + r->moved : r->buf + (r->moved - 4);
    int left = in_header ? 4 - r->moved : r->size - (r->moved - 4);
    if (!in_header && left == 0) return 1;
    ssize_t k = c->sender ? send(c->fd, p, left, MSG_NOSIGNAL) : recv(c->fd, p, left, 0);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      TOY_WARN("%s on comm %p failed: %s", c->sender ? "send" : "receive", (void *)c,
               k == 0 ? "the peer closed" : strerror(errno));
      return -1;
    }
    if (k < 0) return 0;
    r->moved += (int)k;
    if (!c->sender && r->moved == 4) {
      if ((int)r->header > r->size) {
        TOY_WARN("a message of %u bytes for a receive of %d", r->header, r->size);
        return -1;
      }
      r->size = (int)r->header;
    }
  }
}

static ncclResult_t toy_test(void *request, int *done, int *size) {
  struct toy_request *r = request;
  struct toy_comm *c = r->comm;
  while (!r->done && !r->failed && c->count > 0) {
    struct toy_request *head = c->queue[c->head];
    int m = toy_move(c, head);
    if (m == 0) break;
    if (m < 0) {
      head->failed = 1;
    } else {
      head->done = 1;
    }
    c->head = (c->head + 1) % TOY_QUEUE;
    c->count--;
  }
  if (r->failed) {
    free(r);
    return ncclSystemError;
  }
  *done = r->done;
  if (r->done) {
    if (size != NULL) *size = r->size;
    free(r);
  }
  return ncclSuccess;
}

static ncclResult_t toy_close(void *comm) {
  struct toy_comm *c = comm;
  close(c->fd);
  for (int i = 0; i < c->count; i++) free(c->queue[(c->head + i) % TOY_QUEUE]);
  free(c);
  return ncclSuccess;
}

static ncclResult_t toy_close_listen(void *listen_comm) {
  struct toy_listen *l = listen_comm;
  close(l->fd);
  free(l);
  return ncclSuccess;
}

const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = "toy",
    .init = toy_init,
    .devices = toy_devices,
    .getProperties = toy_properties,
    .listen = toy_listen,
    .connect = toy_connect,
    .accept = toy_accept,
    .regMr = toy_reg,
    .deregMr = toy_dereg,
    .isend = toy_isend,
    .irecv = toy_irecv,
    .iflush = toy_iflush,
    .test = toy_test,
    .closeSend = toy_close,
    .closeRecv = toy_close,
    .closeListen = toy_close_listen,
};
