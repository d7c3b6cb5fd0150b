/*
 * crossroads.transport._turnfast — the TURN UDP data plane in C.
 *
 * Optional accelerator for crossroads/transport/turnplane.py, which holds the
 * pure-Python implementation of exactly the same behaviour (used when this
 * module is not built). See that file for the design; in short:
 *
 *   ListenerTap  sits on a STUN/TURN listening UDP socket (as its asyncio
 *                protocol). ChannelData from a known client on a bound channel
 *                is sent straight to the peer from the relay socket; anything
 *                else goes to `fallback(data, addr)` (the STUN endpoint).
 *   RelayTap     is the asyncio protocol of one relay socket. Data from a peer
 *                that has a channel (and a live permission) is sent to the
 *                client as ChannelData; anything else goes to `fallback`.
 *
 * The forwarding tables are the control plane's own Python dicts, read here
 * with PyDict lookups: ListenerTap.clients maps (host, port) -> {channel:
 * (relay, (peer_host, peer_port))}; RelayTap.peer_channels maps (host, port)
 * -> channel. Nothing is copied or kept in sync.
 *
 * Why C: per packet, asyncio/uvloop costs one wakeup, one Python callback
 * and one syscall per direction. After the event loop hands over one
 * datagram, the taps drain the rest of the socket queue with recvmmsg(2)
 * (RECV_BATCH at a time) and send peer->client ChannelData with sendmmsg(2),
 * using two-element iovecs so that no payload is copied. Under load one
 * wakeup moves dozens of datagrams.
 *
 * Everything runs on the event loop thread with the GIL held; the static
 * buffers are safe because no Python code runs between a receive and the
 * flush of what it produced (fallback calls happen after a flush).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

/* recvmmsg/sendmmsg batch (the measured knee of batching is ~8-32,
 * reference §5.2; 32 keeps the static buffers at 2 MiB). */
#define RECV_BATCH 32
/* At most this many batches per wakeup, so one busy socket cannot starve
 * the event loop. */
#define MAX_ROUNDS 8
/* Largest UDP payload. */
#define SLOT 65536

static unsigned char rbuf[RECV_BATCH][SLOT];
static struct mmsghdr rmsg[RECV_BATCH];
static struct iovec riov[RECV_BATCH];
static struct sockaddr_storage raddr[RECV_BATCH];

static struct mmsghdr smsg[RECV_BATCH + 1];
static struct iovec siov[RECV_BATCH + 1][2];
static unsigned char shdr[RECV_BATCH + 1][4];
/* Set while a tap iterates over rbuf: a nested tap call (a fallback that
 * somehow re-enters) must not recvmmsg into the buffers being read. */
static int draining;

/* ------------------------------------------------------------ addresses */

/* (host, port[, ...]) -> sockaddr. Returns 0, or -1 (no exception set). */
static int
sockaddr_from_tuple(PyObject *addr, struct sockaddr_storage *ss, socklen_t *len)
{
    if (!PyTuple_Check(addr) || PyTuple_GET_SIZE(addr) < 2)
        return -1;
    PyObject *host = PyTuple_GET_ITEM(addr, 0);
    PyObject *port = PyTuple_GET_ITEM(addr, 1);
    if (!PyUnicode_Check(host) || !PyLong_Check(port))
        return -1;
    const char *text = PyUnicode_AsUTF8(host);
    if (text == NULL) {
        PyErr_Clear();
        return -1;
    }
    long number = PyLong_AsLong(port);
    if (number < 0 || number > 65535) {
        PyErr_Clear();
        return -1;
    }
    memset(ss, 0, sizeof(*ss));
    struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
    if (inet_pton(AF_INET, text, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((unsigned short)number);
        *len = sizeof(*v4);
        return 0;
    }
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET6, text, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((unsigned short)number);
        *len = sizeof(*v6);
        return 0;
    }
    return -1;
}

/* sockaddr -> (host, port), the key form of the forwarding tables. */
static PyObject *
build_tuple(const struct sockaddr_storage *ss)
{
    char text[INET6_ADDRSTRLEN];
    unsigned short port;
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)ss;
        if (!inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text)))
            return NULL;
        port = ntohs(v4->sin_port);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)ss;
        if (!inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text)))
            return NULL;
        port = ntohs(v6->sin6_port);
    } else {
        return NULL;
    }
    return Py_BuildValue("(sH)", text, port);
}

/* Datagrams come from few addresses (the clients and peers of the live
 * allocations), and formatting an address (inet_ntop, a str, an int, a
 * tuple) costs more than forwarding. A direct-mapped cache of the tuples,
 * keyed by the raw address and port, makes the common case one compare. */
#define ADDR_CACHE 4096

typedef struct {
    unsigned char family;
    unsigned short port;
    unsigned char addr[16];
    PyObject *tuple;
} AddrEntry;

static AddrEntry acache[ADDR_CACHE];

static PyObject *
tuple_from_sockaddr(const struct sockaddr_storage *ss)
{
    unsigned char key[16];
    size_t size;
    unsigned short port;
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)ss;
        memcpy(key, &v4->sin_addr, 4);
        size = 4;
        port = v4->sin_port;
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)ss;
        memcpy(key, &v6->sin6_addr, 16);
        size = 16;
        port = v6->sin6_port;
    } else {
        return NULL;
    }
    unsigned int h = port * 2654435761u;
    for (size_t i = 0; i < size; i++)
        h = (h ^ key[i]) * 16777619u;
    AddrEntry *e = &acache[(h >> 8) & (ADDR_CACHE - 1)];
    if (e->tuple != NULL && e->family == ss->ss_family && e->port == port &&
        memcmp(e->addr, key, size) == 0) {
        Py_INCREF(e->tuple);
        return e->tuple;
    }
    PyObject *tuple = build_tuple(ss);
    if (tuple == NULL)
        return NULL;
    Py_XSETREF(e->tuple, Py_NewRef(tuple));
    e->family = (unsigned char)ss->ss_family;
    e->port = port;
    memcpy(e->addr, key, size);
    return tuple;
}

/* A 2-tuple key from whatever address form the event loop handed over. */
static PyObject *
key_from_addr(PyObject *addr)
{
    if (PyTuple_Check(addr) && PyTuple_GET_SIZE(addr) == 2) {
        Py_INCREF(addr);
        return addr;
    }
    if (PyTuple_Check(addr) && PyTuple_GET_SIZE(addr) > 2)
        return PyTuple_GetSlice(addr, 0, 2);
    return NULL;
}

/* ------------------------------------------------------------ counters */

#define COUNTER_MEMBERS(Type)                                                   \
    {"forwarded", T_ULONGLONG, offsetof(Type, c.forwarded), READONLY,             \
     "Datagrams forwarded in C."},                                             \
    {"forwarded_bytes", T_ULONGLONG, offsetof(Type, c.forwarded_bytes), READONLY, \
     "Payload bytes forwarded in C."},                                         \
    {"send_errors", T_ULONGLONG, offsetof(Type, c.send_errors), READONLY,         \
     "Sends that failed (dropped)."},                                          \
    {"malformed", T_ULONGLONG, offsetof(Type, c.malformed), READONLY,             \
     "Truncated, padded-too-much or oversized datagrams dropped."},            \
    {"batches", T_ULONGLONG, offsetof(Type, c.batches), READONLY,                 \
     "recvmmsg calls that returned datagrams."},                               \
    {"drained", T_ULONGLONG, offsetof(Type, c.drained), READONLY,                 \
     "Datagrams read by recvmmsg (beyond those the event loop delivered)."},    \
    {"throttled", T_ULONGLONG, offsetof(Type, c.throttled), READONLY,             \
     "Datagrams dropped by the relay's bandwidth limit."}

#define COUNTER_FIELDS            \
    unsigned long long forwarded; \
    unsigned long long forwarded_bytes; \
    unsigned long long send_errors; \
    unsigned long long malformed; \
    unsigned long long batches;   \
    unsigned long long drained;   \
    unsigned long long throttled

typedef struct {
    COUNTER_FIELDS;
} Counters;

/* ------------------------------------------------------------ RelayTap */

typedef struct {
    PyObject_HEAD
    int fd;
    int client_fd;
    struct sockaddr_storage client_sa;
    socklen_t client_salen;
    PyObject *peer_channels; /* dict (host, port) -> channel */
    PyObject *fallback;      /* callable(data, addr) */
    PyObject *dict;
    Counters c;
    int queued;
    int skip, misses;
    /* Bandwidth limit of the allocation, both directions (bytes/s; 0 = none):
     * a token bucket holding at most one second's worth. */
    double bps, tokens, stamp;
} RelayTap;

static PyTypeObject RelayTapType;

/* Whether `size` more bytes fit the relay's bandwidth budget now. */
static int
budget_ok(RelayTap *r, size_t size)
{
    if (r->bps <= 0)
        return 1;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    double tokens = r->tokens + (now - r->stamp) * r->bps;
    if (tokens > r->bps)
        tokens = r->bps;
    r->stamp = now;
    if (tokens < (double)size) {
        r->tokens = tokens;
        r->c.throttled += 1;
        return 0;
    }
    r->tokens = tokens - (double)size;
    return 1;
}

static void
relay_flush(RelayTap *self)
{
    int start = 0;
    while (start < self->queued) {
        int sent = sendmmsg(self->client_fd, &smsg[start], self->queued - start,
                            MSG_DONTWAIT);
        if (sent <= 0) {
            if (sent < 0 && errno == EINTR)
                continue;
            self->c.send_errors += (unsigned long long)(self->queued - start);
            break;
        }
        for (int i = start; i < start + sent; i++) {
            self->c.forwarded += 1;
            self->c.forwarded_bytes += siov[i][1].iov_len;
        }
        start += sent;
    }
    self->queued = 0;
}

static void
relay_queue(RelayTap *self, long channel, const unsigned char *payload, size_t size)
{
    int i = self->queued;
    shdr[i][0] = (unsigned char)(channel >> 8);
    shdr[i][1] = (unsigned char)channel;
    shdr[i][2] = (unsigned char)(size >> 8);
    shdr[i][3] = (unsigned char)size;
    siov[i][0].iov_base = shdr[i];
    siov[i][0].iov_len = 4;
    siov[i][1].iov_base = (void *)payload;
    siov[i][1].iov_len = size;
    memset(&smsg[i], 0, sizeof(smsg[i]));
    smsg[i].msg_hdr.msg_name = &self->client_sa;
    smsg[i].msg_hdr.msg_namelen = self->client_salen;
    smsg[i].msg_hdr.msg_iov = siov[i];
    smsg[i].msg_hdr.msg_iovlen = 2;
    self->queued = i + 1;
}

/* One datagram from a peer. `data` may be NULL (then the bytes are built for
 * the fallback from buf/size). Returns 0, or -1 with an exception set. */
static int
relay_one(RelayTap *self, const unsigned char *buf, size_t size, PyObject *key,
          PyObject *data)
{
    PyObject *channel = PyDict_GetItemWithError(self->peer_channels, key);
    if (channel != NULL && PyLong_Check(channel) && size <= 0xFFFF) {
        if (budget_ok(self, size))
            relay_queue(self, PyLong_AsLong(channel), buf, size);
        return 0;
    }
    if (PyErr_Occurred())
        return -1;
    /* Not ours to forward: keep order, flush first, then Python decides
     * (Data indication with a permission, or a counted drop). */
    if (self->queued)
        relay_flush(self);
    PyObject *bytes = data;
    if (bytes == NULL) {
        bytes = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)size);
        if (bytes == NULL)
            return -1;
    } else {
        Py_INCREF(bytes);
    }
    PyObject *result = PyObject_CallFunctionObjArgs(self->fallback, bytes, key, NULL);
    Py_DECREF(bytes);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

static void
prepare_recv(void)
{
    for (int i = 0; i < RECV_BATCH; i++) {
        riov[i].iov_base = rbuf[i];
        riov[i].iov_len = SLOT;
        memset(&rmsg[i].msg_hdr, 0, sizeof(rmsg[i].msg_hdr));
        rmsg[i].msg_hdr.msg_name = &raddr[i];
        rmsg[i].msg_hdr.msg_namelen = sizeof(raddr[i]);
        rmsg[i].msg_hdr.msg_iov = &riov[i];
        rmsg[i].msg_hdr.msg_iovlen = 1;
    }
}

/* Whether to try a drain now. A drain that finds the queue empty costs a
 * syscall for nothing, so after each empty one the next 2^k - 1 callbacks
 * (k <= 6) skip it; any non-empty drain resets this. At low rates the
 * event loop's one-datagram callbacks are all there is; under load most
 * drains return a full batch. */
static int
should_drain(int *skip)
{
    if (*skip > 0) {
        (*skip)--;
        return 0;
    }
    return 1;
}

static void
drain_result(int n, int *skip, int *misses)
{
    if (n > 0) {
        *misses = 0;
    } else {
        if (*misses < 6)
            (*misses)++;
        *skip = (1 << *misses) - 1;
    }
}

static int
receive_batch(int fd)
{
    prepare_recv();
    int n;
    do {
        n = recvmmsg(fd, rmsg, RECV_BATCH, MSG_DONTWAIT, NULL);
    } while (n < 0 && errno == EINTR);
    return n;
}

/* Drain the relay socket: recvmmsg batches, ChannelData out with sendmmsg. */
static PyObject *
relay_drain(RelayTap *self)
{
    if (self->fd < 0 || draining)
        Py_RETURN_NONE;
    draining = 1;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        int n = receive_batch(self->fd);
        if (round == 0)
            drain_result(n, &self->skip, &self->misses);
        if (n <= 0)
            break;
        self->c.batches += 1;
        self->c.drained += (unsigned long long)n;
        for (int i = 0; i < n; i++) {
            if (rmsg[i].msg_hdr.msg_flags & MSG_TRUNC) {
                self->c.malformed += 1;
                continue;
            }
            PyObject *peer = tuple_from_sockaddr(&raddr[i]);
            if (peer == NULL) {
                PyErr_Clear();
                self->c.malformed += 1;
                continue;
            }
            int rc = relay_one(self, rbuf[i], rmsg[i].msg_len, peer, NULL);
            Py_DECREF(peer);
            if (rc < 0) {
                relay_flush(self);
                draining = 0;
                return NULL;
            }
        }
        if (self->queued)
            relay_flush(self);
        if (n < RECV_BATCH)
            break;
    }
    draining = 0;
    Py_RETURN_NONE;
}

static PyObject *
RelayTap_datagram_received(RelayTap *self, PyObject *args)
{
    PyObject *data, *addr;
    if (!PyArg_ParseTuple(args, "SO", &data, &addr))
        return NULL;
    if (self->peer_channels == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RelayTap not configured");
        return NULL;
    }
    PyObject *key = key_from_addr(addr);
    if (key == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bad address");
        return NULL;
    }
    int rc = relay_one(self, (const unsigned char *)PyBytes_AS_STRING(data),
                       (size_t)PyBytes_GET_SIZE(data), key, data);
    Py_DECREF(key);
    if (rc < 0)
        return NULL;
    /* The queued send may point into `data`: flush before it can go away. */
    if (self->queued)
        relay_flush(self);
    if (!should_drain(&self->skip))
        Py_RETURN_NONE;
    return relay_drain(self);
}

/* For loop.add_reader(fd, relay.readable): the relay reads its socket. */
static PyObject *
RelayTap_readable(RelayTap *self, PyObject *unused)
{
    if (self->peer_channels == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RelayTap not configured");
        return NULL;
    }
    self->skip = 0;
    return relay_drain(self);
}

static PyObject *
RelayTap_set_client(RelayTap *self, PyObject *args)
{
    int fd;
    PyObject *addr, *unused = NULL;
    if (!PyArg_ParseTuple(args, "iO|O", &fd, &addr, &unused))
        return NULL;
    if (sockaddr_from_tuple(addr, &self->client_sa, &self->client_salen) < 0) {
        PyErr_SetString(PyExc_ValueError, "client address must be (ip, port)");
        return NULL;
    }
    self->client_fd = fd;
    Py_RETURN_NONE;
}

static int
RelayTap_init(RelayTap *self, PyObject *args, PyObject *kwds)
{
    self->fd = -1;
    self->client_fd = -1;
    return 0;
}

static int
RelayTap_traverse(RelayTap *self, visitproc visit, void *arg)
{
    Py_VISIT(self->peer_channels);
    Py_VISIT(self->fallback);
    Py_VISIT(self->dict);
    return 0;
}

static int
RelayTap_clear(RelayTap *self)
{
    Py_CLEAR(self->peer_channels);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->dict);
    return 0;
}

static void
RelayTap_dealloc(RelayTap *self)
{
    PyObject_GC_UnTrack(self);
    RelayTap_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
RelayTap_allow(RelayTap *self, PyObject *arg)
{
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "size must be >= 0");
        return NULL;
    }
    return PyBool_FromLong(budget_ok(self, (size_t)size));
}

static PyMethodDef RelayTap_methods[] = {
    {"readable", (PyCFunction)RelayTap_readable, METH_NOARGS,
     "Drain the socket (for loop.add_reader)."},
    {"allow", (PyCFunction)RelayTap_allow, METH_O,
     "allow(size): spend `size` bytes of the bandwidth budget (False: drop)."},
    {"datagram_received", (PyCFunction)RelayTap_datagram_received, METH_VARARGS,
     "Forward peer data to the client (asyncio DatagramProtocol callback)."},
    {"set_client", (PyCFunction)RelayTap_set_client, METH_VARARGS,
     "set_client(fd, (host, port)[, sendto]): where ChannelData goes."},
    {NULL},
};

static PyMemberDef RelayTap_members[] = {
    {"fd", T_INT, offsetof(RelayTap, fd), 0, "Relay socket fd (-1: no drain)."},
    {"bps", T_DOUBLE, offsetof(RelayTap, bps), 0,
     "Bandwidth limit in bytes/s, both directions (0: none)."},
    {"peer_channels", T_OBJECT_EX, offsetof(RelayTap, peer_channels), 0,
     "dict (host, port) -> channel number."},
    {"fallback", T_OBJECT_EX, offsetof(RelayTap, fallback), 0,
     "callable(data, addr) for datagrams not forwarded here."},
    COUNTER_MEMBERS(RelayTap),
    {NULL},
};

static PyTypeObject RelayTapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.RelayTap",
    .tp_basicsize = sizeof(RelayTap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Peer -> client ChannelData forwarding for one relay socket.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RelayTap_init,
    .tp_dealloc = (destructor)RelayTap_dealloc,
    .tp_traverse = (traverseproc)RelayTap_traverse,
    .tp_clear = (inquiry)RelayTap_clear,
    .tp_methods = RelayTap_methods,
    .tp_members = RelayTap_members,
    .tp_dictoffset = offsetof(RelayTap, dict),
};

/* ------------------------------------------------------------ ListenerTap */

typedef struct {
    PyObject_HEAD
    int fd;
    PyObject *clients;  /* dict (host, port) -> {channel: (relay, peer)} */
    PyObject *fallback; /* callable(data, addr) */
    PyObject *dict;
    Counters c;
    int skip, misses;
} ListenerTap;

/* Try to forward one ChannelData datagram from a client whose channel table
 * (channel -> (relay, peer)) is looked up in `clients` by `key`.
 * Returns 1 when handled (forwarded, or dropped as malformed), 0 when it is
 * not ours to forward, -1 with an exception set. */
static int
forward_channel_data(PyObject *clients, const unsigned char *buf, size_t size,
                     PyObject *key, Counters *c)
{
    if (size < 4 || buf[0] < 0x40 || buf[0] >= 0x80)
        return 0;
    PyObject *routes = PyDict_GetItemWithError(clients, key);
    if (routes == NULL || !PyDict_Check(routes))
        return PyErr_Occurred() ? -1 : 0;
    long number = ((long)buf[0] << 8) | buf[1];
    PyObject *channel = PyLong_FromLong(number);
    if (channel == NULL)
        return -1;
    PyObject *route = PyDict_GetItemWithError(routes, channel);
    Py_DECREF(channel);
    if (route == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(route) || PyTuple_GET_SIZE(route) != 2 ||
        !PyObject_TypeCheck(PyTuple_GET_ITEM(route, 0), &RelayTapType))
        return 0;
    RelayTap *relay = (RelayTap *)PyTuple_GET_ITEM(route, 0);
    size_t length = ((size_t)buf[2] << 8) | buf[3];
    /* RFC 8656 §12.5: shorter than claimed is dropped; up to 3 bytes of
     * padding may follow (optional over UDP, mandatory over TCP). */
    if (size < 4 + length || size - 4 - length > 3) {
        c->malformed += 1;
        return 1;
    }
    struct sockaddr_storage sa;
    socklen_t salen;
    if (relay->fd < 0 ||
        sockaddr_from_tuple(PyTuple_GET_ITEM(route, 1), &sa, &salen) != 0)
        return 0;
    if (!budget_ok(relay, length))
        return 1; /* counted on the relay */
    ssize_t sent;
    do {
        sent = sendto(relay->fd, buf + 4, length, MSG_DONTWAIT,
                      (struct sockaddr *)&sa, salen);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) {
        c->send_errors += 1;
    } else {
        c->forwarded += 1;
        c->forwarded_bytes += length;
    }
    return 1;
}

static int
call_fallback(PyObject *fallback, const unsigned char *buf, size_t size,
              PyObject *data, PyObject *arg1, PyObject *arg2)
{
    PyObject *bytes = data;
    if (bytes == NULL) {
        bytes = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)size);
        if (bytes == NULL)
            return -1;
    } else {
        Py_INCREF(bytes);
    }
    PyObject *result = PyObject_CallFunctionObjArgs(fallback, bytes, arg1, arg2, NULL);
    Py_DECREF(bytes);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* One datagram from a client. Returns 0, or -1 with an exception set. */
static int
listener_one(ListenerTap *self, const unsigned char *buf, size_t size,
             PyObject *key, PyObject *data, PyObject *addr)
{
    int rc = forward_channel_data(self->clients, buf, size, key,
                                  &self->c);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    return call_fallback(self->fallback, buf, size, data, addr, NULL);
}

/* Drain the listening socket: recvmmsg batches, forward or fall back. */
static PyObject *
listener_drain(ListenerTap *self)
{
    if (self->fd < 0 || draining)
        Py_RETURN_NONE;
    draining = 1;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        int n = receive_batch(self->fd);
        if (round == 0)
            drain_result(n, &self->skip, &self->misses);
        if (n <= 0)
            break;
        self->c.batches += 1;
        self->c.drained += (unsigned long long)n;
        for (int i = 0; i < n; i++) {
            if (rmsg[i].msg_hdr.msg_flags & MSG_TRUNC) {
                self->c.malformed += 1;
                continue;
            }
            PyObject *peer = tuple_from_sockaddr(&raddr[i]);
            if (peer == NULL) {
                PyErr_Clear();
                self->c.malformed += 1;
                continue;
            }
            int rc = listener_one(self, rbuf[i], rmsg[i].msg_len, peer, NULL, peer);
            Py_DECREF(peer);
            if (rc < 0) {
                draining = 0;
                return NULL;
            }
        }
        if (n < RECV_BATCH)
            break;
    }
    draining = 0;
    Py_RETURN_NONE;
}

static PyObject *
ListenerTap_datagram_received(ListenerTap *self, PyObject *args)
{
    PyObject *data, *addr;
    if (!PyArg_ParseTuple(args, "SO", &data, &addr))
        return NULL;
    if (self->clients == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ListenerTap not configured");
        return NULL;
    }
    PyObject *key = key_from_addr(addr);
    if (key == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bad address");
        return NULL;
    }
    int rc = listener_one(self, (const unsigned char *)PyBytes_AS_STRING(data),
                          (size_t)PyBytes_GET_SIZE(data), key, data, addr);
    Py_DECREF(key);
    if (rc < 0)
        return NULL;
    if (!should_drain(&self->skip))
        Py_RETURN_NONE;
    return listener_drain(self);
}

/* For loop.add_reader(fd, tap.readable): the tap reads the socket itself. */
static PyObject *
ListenerTap_readable(ListenerTap *self, PyObject *unused)
{
    if (self->clients == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ListenerTap not configured");
        return NULL;
    }
    self->skip = 0;
    return listener_drain(self);
}

static int
ListenerTap_init(ListenerTap *self, PyObject *args, PyObject *kwds)
{
    self->fd = -1;
    return 0;
}

static int
ListenerTap_traverse(ListenerTap *self, visitproc visit, void *arg)
{
    Py_VISIT(self->clients);
    Py_VISIT(self->fallback);
    Py_VISIT(self->dict);
    return 0;
}

static int
ListenerTap_clear(ListenerTap *self)
{
    Py_CLEAR(self->clients);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->dict);
    return 0;
}

static void
ListenerTap_dealloc(ListenerTap *self)
{
    PyObject_GC_UnTrack(self);
    ListenerTap_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ListenerTap_methods[] = {
    {"datagram_received", (PyCFunction)ListenerTap_datagram_received, METH_VARARGS,
     "Forward client ChannelData (asyncio DatagramProtocol callback)."},
    {"readable", (PyCFunction)ListenerTap_readable, METH_NOARGS,
     "Drain the socket (for loop.add_reader)."},
    {NULL},
};

static PyMemberDef ListenerTap_members[] = {
    {"fd", T_INT, offsetof(ListenerTap, fd), 0, "Listening socket fd (-1: no drain)."},
    {"clients", T_OBJECT_EX, offsetof(ListenerTap, clients), 0,
     "dict (host, port) -> {channel: (relay, peer)}."},
    {"fallback", T_OBJECT_EX, offsetof(ListenerTap, fallback), 0,
     "callable(data, addr) for datagrams not forwarded here."},
    COUNTER_MEMBERS(ListenerTap),
    {NULL},
};

static PyTypeObject ListenerTapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.ListenerTap",
    .tp_basicsize = sizeof(ListenerTap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Client -> peer ChannelData forwarding for one listening socket.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ListenerTap_init,
    .tp_dealloc = (destructor)ListenerTap_dealloc,
    .tp_traverse = (traverseproc)ListenerTap_traverse,
    .tp_clear = (inquiry)ListenerTap_clear,
    .tp_methods = ListenerTap_methods,
    .tp_members = ListenerTap_members,
    .tp_dictoffset = offsetof(ListenerTap, dict),
};

/* ------------------------------------------------------------ ChannelRouter */

/* For listeners that read their own socket (the STUN service's batched
 * recvmmsg endpoints) and TCP connections: they call
 * handle_channel_data(data, client, endpoint) per ChannelData message. */
typedef struct {
    PyObject_HEAD
    PyObject *endpoints; /* dict endpoint -> {(host, port): {channel: route}} */
    PyObject *fallback;  /* callable(data, client, endpoint) */
    PyObject *dict;
    Counters c;
} ChannelRouter;

static PyObject *
ChannelRouter_handle(ChannelRouter *self, PyObject *args)
{
    PyObject *data, *client, *endpoint;
    if (!PyArg_ParseTuple(args, "SOO", &data, &client, &endpoint))
        return NULL;
    if (self->endpoints == NULL || self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChannelRouter not configured");
        return NULL;
    }
    PyObject *clients = PyDict_GetItemWithError(self->endpoints, endpoint);
    if (clients != NULL && PyDict_Check(clients)) {
        int rc = forward_channel_data(
            clients, (const unsigned char *)PyBytes_AS_STRING(data),
            (size_t)PyBytes_GET_SIZE(data), client, &self->c);
        if (rc < 0)
            return NULL;
        if (rc > 0)
            Py_RETURN_NONE;
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *result =
        PyObject_CallFunctionObjArgs(self->fallback, data, client, endpoint, NULL);
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_NONE;
}

static int
ChannelRouter_traverse(ChannelRouter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->endpoints);
    Py_VISIT(self->fallback);
    Py_VISIT(self->dict);
    return 0;
}

static int
ChannelRouter_clear(ChannelRouter *self)
{
    Py_CLEAR(self->endpoints);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->dict);
    return 0;
}

static void
ChannelRouter_dealloc(ChannelRouter *self)
{
    PyObject_GC_UnTrack(self);
    ChannelRouter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ChannelRouter_methods[] = {
    {"handle_channel_data", (PyCFunction)ChannelRouter_handle, METH_VARARGS,
     "handle_channel_data(data, client, endpoint): forward or fall back."},
    {NULL},
};

static PyMemberDef ChannelRouter_members[] = {
    {"endpoints", T_OBJECT_EX, offsetof(ChannelRouter, endpoints), 0,
     "dict endpoint -> {(host, port): {channel: (relay, peer)}}."},
    {"fallback", T_OBJECT_EX, offsetof(ChannelRouter, fallback), 0,
     "callable(data, client, endpoint) for what is not forwarded here."},
    COUNTER_MEMBERS(ChannelRouter),
    {NULL},
};

static PyTypeObject ChannelRouterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.ChannelRouter",
    .tp_basicsize = sizeof(ChannelRouter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Client -> peer ChannelData forwarding for hook callers.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)ChannelRouter_dealloc,
    .tp_traverse = (traverseproc)ChannelRouter_traverse,
    .tp_clear = (inquiry)ChannelRouter_clear,
    .tp_methods = ChannelRouter_methods,
    .tp_members = ChannelRouter_members,
    .tp_dictoffset = offsetof(ChannelRouter, dict),
};

/* ------------------------------------------------------------ Route / RouteTap */

/* The generic half of the data plane: a socket whose datagrams are forwarded
 * by a route table the control plane writes (see dataplane.py for the design
 * and the pure-Python twin). The key is the source (host, port), or
 * ((host, port), first `prefix` bytes) when a protocol names its route in a
 * header (the Unity relay's RELAY frame: header + from/to allocation ids).
 * The value is a Route: an out socket, a destination and the route's
 * counters. Datagrams are forwarded unchanged; what has no route goes to
 * `fallback(data, addr)`. */

/* Largest control message a route sends with: in6_pktinfo is 20 bytes
 * (ipv6(7)), in_pktinfo 12 (ip(7)) -- the source address of a reply on a
 * wildcard bind (pktinfo.py). */
#define ROUTE_CONTROL 20
/* Room for the control messages a tap receives (both pktinfo options may be
 * on for a dual-stack socket; pktinfo.ANCILLARY_BYTES). */
#define TAP_CONTROL 128

static unsigned char rctl[RECV_BATCH][TAP_CONTROL];
static unsigned char sctl[RECV_BATCH + 1][CMSG_SPACE(ROUTE_CONTROL)];

typedef struct {
    PyObject_HEAD
    int out_fd;
    struct sockaddr_storage dest_sa;
    socklen_t dest_salen;
    PyObject *sock; /* the out socket: kept alive while the route exists */
    PyObject *dest; /* (host, port) */
    PyObject *control; /* None, or (level, type, data): sendmsg ancillary data */
    int clevel, ctype;
    unsigned char cdata[ROUTE_CONTROL];
    size_t clen;
    unsigned long long packets;
    unsigned long long octets;
} Route;

static PyTypeObject RouteType;

/* sock.fileno(), or -1 with an exception set (a closed socket's -1 is refused). */
static int
fd_of(PyObject *sock)
{
    PyObject *fileno = PyObject_CallMethod(sock, "fileno", NULL);
    if (fileno == NULL)
        return -1;
    long fd = PyLong_AsLong(fileno);
    Py_DECREF(fileno);
    if (fd < 0 || fd > INT_MAX) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "the socket is closed");
        return -1;
    }
    return (int)fd;
}

static int
Route_init(Route *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"sock", "dest", "control", NULL};
    PyObject *sock, *dest, *control = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O", names, &sock, &dest,
                                     &control))
        return -1;
    self->clen = 0;
    if (control != Py_None) {
        int level, type;
        const char *cdata;
        Py_ssize_t clen;
        if (!PyArg_ParseTuple(control, "iiy#;control must be (level, type, bytes)",
                              &level, &type, &cdata, &clen))
            return -1;
        if (clen <= 0 || clen > ROUTE_CONTROL) {
            PyErr_SetString(PyExc_ValueError, "control data must be 1-20 bytes");
            return -1;
        }
        self->clevel = level;
        self->ctype = type;
        memcpy(self->cdata, cdata, (size_t)clen);
        self->clen = (size_t)clen;
    }
    Py_XSETREF(self->control, Py_NewRef(control));
    int fd = fd_of(sock);
    if (fd < 0)
        return -1;
    if (sockaddr_from_tuple(dest, &self->dest_sa, &self->dest_salen) < 0) {
        PyErr_SetString(PyExc_ValueError, "dest must be (ip, port)");
        return -1;
    }
    self->out_fd = fd;
    Py_XSETREF(self->sock, Py_NewRef(sock));
    PyObject *key = PyTuple_GetSlice(dest, 0, 2);
    if (key == NULL)
        return -1;
    Py_XSETREF(self->dest, key);
    return 0;
}

static int
Route_traverse(Route *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sock);
    Py_VISIT(self->dest);
    Py_VISIT(self->control);
    return 0;
}

static int
Route_clear(Route *self)
{
    Py_CLEAR(self->sock);
    Py_CLEAR(self->dest);
    Py_CLEAR(self->control);
    return 0;
}

static void
Route_dealloc(Route *self)
{
    PyObject_GC_UnTrack(self);
    Route_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Route_members[] = {
    {"sock", T_OBJECT_EX, offsetof(Route, sock), READONLY, "The socket it leaves from."},
    {"dest", T_OBJECT_EX, offsetof(Route, dest), READONLY, "(host, port) it goes to."},
    {"control", T_OBJECT_EX, offsetof(Route, control), READONLY,
     "None, or the (level, type, data) control message sent with each datagram."},
    {"packets", T_ULONGLONG, offsetof(Route, packets), 0,
     "Datagrams that took this route (sent or not)."},
    {"octets", T_ULONGLONG, offsetof(Route, octets), 0,
     "Bytes of those datagrams."},
    {NULL},
};

static PyTypeObject RouteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.Route",
    .tp_basicsize = sizeof(Route),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Route(sock, dest[, control]): forward unchanged from `sock` to `dest`.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Route_init,
    .tp_dealloc = (destructor)Route_dealloc,
    .tp_traverse = (traverseproc)Route_traverse,
    .tp_clear = (inquiry)Route_clear,
    .tp_members = Route_members,
};

/* Longest key prefix (the Unity relay's is 36 bytes). */
#define MAX_PREFIX 64

typedef struct {
    PyObject_HEAD
    int fd;
    int prefix;      /* bytes of the datagram in the key; 0: the address alone */
    int length_at;   /* -1, or offset of a u16 BE that must equal the rest's size */
    int max_size;    /* larger datagrams are dropped as malformed */
    char ancillary;  /* receive control messages, hand them to the fallback */
    PyObject *sock;
    PyObject *routes;   /* dict key -> Route */
    PyObject *fallback; /* callable(data, (host, port)) */
    PyObject *dict;
    Counters c;
    int queued;
    int queued_fd;
    PyObject *held[RECV_BATCH]; /* the queued routes (their sockaddrs are in use) */
} RouteTap;

static PyTypeObject RouteTapType;

static void
route_flush(RouteTap *self)
{
    int start = 0;
    while (start < self->queued) {
        int sent = sendmmsg(self->queued_fd, &smsg[start], self->queued - start,
                            MSG_DONTWAIT);
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent <= 0) {
            /* One failed datagram (a full buffer, an ICMP error pending on
             * the socket) must not take the rest of the batch with it. */
            self->c.send_errors += 1;
            start += 1;
            continue;
        }
        for (int i = start; i < start + sent; i++) {
            self->c.forwarded += 1;
            self->c.forwarded_bytes += siov[i][0].iov_len;
        }
        start += sent;
    }
    for (int i = 0; i < self->queued; i++)
        Py_DECREF(self->held[i]);
    self->queued = 0;
}

static void
route_queue(RouteTap *self, Route *route, const unsigned char *payload, size_t size)
{
    if (self->queued && (self->queued_fd != route->out_fd || self->queued == RECV_BATCH))
        route_flush(self);
    int i = self->queued;
    siov[i][0].iov_base = (void *)payload;
    siov[i][0].iov_len = size;
    memset(&smsg[i], 0, sizeof(smsg[i]));
    smsg[i].msg_hdr.msg_name = &route->dest_sa;
    smsg[i].msg_hdr.msg_namelen = route->dest_salen;
    smsg[i].msg_hdr.msg_iov = siov[i];
    smsg[i].msg_hdr.msg_iovlen = 1;
    if (route->clen) {
        memset(sctl[i], 0, sizeof(sctl[i]));
        smsg[i].msg_hdr.msg_control = sctl[i];
        smsg[i].msg_hdr.msg_controllen = CMSG_SPACE(route->clen);
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&smsg[i].msg_hdr);
        cmsg->cmsg_level = route->clevel;
        cmsg->cmsg_type = route->ctype;
        cmsg->cmsg_len = CMSG_LEN(route->clen);
        memcpy(CMSG_DATA(cmsg), route->cdata, route->clen);
    }
    Py_INCREF(route);
    self->held[i] = (PyObject *)route;
    self->queued_fd = route->out_fd;
    self->queued = i + 1;
}

/* Whether the datagram's own length field agrees with its size. */
static int
length_ok(RouteTap *self, const unsigned char *buf, size_t size)
{
    if (self->length_at < 0)
        return 1;
    size_t at = (size_t)self->length_at;
    return size >= at + 2 && size - at - 2 == (((size_t)buf[at] << 8) | buf[at + 1]);
}

/* The control messages of received datagram `i` as recvmsg's ancdata list:
 * [(level, type, data), ...]. */
static PyObject *
ancdata_list(int i)
{
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    struct msghdr *hdr = &rmsg[i].msg_hdr;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(hdr); c != NULL; c = CMSG_NXTHDR(hdr, c)) {
        size_t len = c->cmsg_len - CMSG_LEN(0);
        PyObject *item = Py_BuildValue("(iiy#)", c->cmsg_level, c->cmsg_type,
                                       (const char *)CMSG_DATA(c), (Py_ssize_t)len);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

/* One datagram (number `i` of the batch). Returns 0, or -1 with an
 * exception set. */
static int
route_one(RouteTap *self, int i, const unsigned char *buf, size_t size, PyObject *addr)
{
    if (size > (size_t)self->max_size) {
        self->c.malformed += 1;
        return 0;
    }
    PyObject *route = NULL;
    if (self->prefix == 0) {
        route = PyDict_GetItemWithError(self->routes, addr);
    } else if (size >= (size_t)self->prefix) {
        PyObject *key = Py_BuildValue("(Oy#)", addr, (const char *)buf,
                                      (Py_ssize_t)self->prefix);
        if (key == NULL)
            return -1;
        route = PyDict_GetItemWithError(self->routes, key);
        Py_DECREF(key);
    }
    if (route == NULL && PyErr_Occurred())
        return -1;
    if (route != NULL && PyObject_TypeCheck(route, &RouteType) &&
        length_ok(self, buf, size)) {
        Route *r = (Route *)route;
        r->packets += 1;
        r->octets += size;
        route_queue(self, r, buf, size);
        return 0;
    }
    /* Not ours to forward: keep order, flush first, then Python decides. */
    if (self->queued)
        route_flush(self);
    if (!self->ancillary)
        return call_fallback(self->fallback, buf, size, NULL, addr, NULL);
    PyObject *ancdata = ancdata_list(i);
    if (ancdata == NULL)
        return -1;
    int rc = call_fallback(self->fallback, buf, size, NULL, addr, ancdata);
    Py_DECREF(ancdata);
    return rc;
}

static PyObject *
route_drain(RouteTap *self)
{
    if (self->fd < 0 || draining)
        Py_RETURN_NONE;
    draining = 1;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        prepare_recv();
        if (self->ancillary) {
            for (int i = 0; i < RECV_BATCH; i++) {
                rmsg[i].msg_hdr.msg_control = rctl[i];
                rmsg[i].msg_hdr.msg_controllen = TAP_CONTROL;
            }
        }
        int n;
        do {
            n = recvmmsg(self->fd, rmsg, RECV_BATCH, MSG_DONTWAIT, NULL);
        } while (n < 0 && errno == EINTR);
        if (n <= 0)
            break;
        self->c.batches += 1;
        self->c.drained += (unsigned long long)n;
        for (int i = 0; i < n; i++) {
            if (rmsg[i].msg_hdr.msg_flags & MSG_TRUNC) {
                self->c.malformed += 1;
                continue;
            }
            PyObject *addr = tuple_from_sockaddr(&raddr[i]);
            if (addr == NULL) {
                PyErr_Clear();
                self->c.malformed += 1;
                continue;
            }
            int rc = route_one(self, i, rbuf[i], rmsg[i].msg_len, addr);
            Py_DECREF(addr);
            if (rc < 0) {
                if (self->queued)
                    route_flush(self);
                draining = 0;
                return NULL;
            }
            /* The fallback closed this tap (a released pair): the rest of
             * the batch belongs to nobody. */
            if (self->fd < 0)
                break;
        }
        if (self->queued)
            route_flush(self);
        /* The fallback may have closed this tap (a released pair). */
        if (n < RECV_BATCH || self->fd < 0)
            break;
    }
    draining = 0;
    Py_RETURN_NONE;
}

static PyObject *
RouteTap_readable(RouteTap *self, PyObject *unused)
{
    return route_drain(self);
}

static PyObject *
RouteTap_close(RouteTap *self, PyObject *unused)
{
    self->fd = -1;
    Py_RETURN_NONE;
}

static int
RouteTap_init(RouteTap *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"sock", "routes", "fallback", "prefix", "length_at",
                            "max_size", "ancillary", NULL};
    PyObject *sock, *routes, *fallback;
    int prefix = 0, length_at = -1, max_size = 65535, ancillary = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O|$iiip", names, &sock,
                                     &PyDict_Type, &routes, &fallback, &prefix,
                                     &length_at, &max_size, &ancillary))
        return -1;
    if (prefix < 0 || prefix > MAX_PREFIX || length_at < -1 || length_at > 65533 ||
        max_size < 0 || max_size > 65535) {
        PyErr_SetString(PyExc_ValueError, "prefix, length_at or max_size out of range");
        return -1;
    }
    int fd = fd_of(sock);
    if (fd < 0)
        return -1;
    self->fd = fd;
    self->prefix = prefix;
    self->length_at = length_at;
    self->max_size = max_size;
    self->ancillary = (char)ancillary;
    Py_XSETREF(self->sock, Py_NewRef(sock));
    Py_XSETREF(self->routes, Py_NewRef(routes));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    return 0;
}

static int
RouteTap_traverse(RouteTap *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sock);
    Py_VISIT(self->routes);
    Py_VISIT(self->fallback);
    Py_VISIT(self->dict);
    return 0;
}

static int
RouteTap_clear(RouteTap *self)
{
    Py_CLEAR(self->sock);
    Py_CLEAR(self->routes);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->dict);
    return 0;
}

static void
RouteTap_dealloc(RouteTap *self)
{
    PyObject_GC_UnTrack(self);
    RouteTap_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef RouteTap_methods[] = {
    {"readable", (PyCFunction)RouteTap_readable, METH_NOARGS,
     "Drain the socket (for loop.add_reader)."},
    {"close", (PyCFunction)RouteTap_close, METH_NOARGS,
     "Stop reading (the owner closes the socket)."},
    {NULL},
};

static PyMemberDef RouteTap_members[] = {
    {"fd", T_INT, offsetof(RouteTap, fd), READONLY, "Socket fd (-1: closed)."},
    {"prefix", T_INT, offsetof(RouteTap, prefix), READONLY,
     "Datagram bytes in the route key (0: the source address alone)."},
    {"length_at", T_INT, offsetof(RouteTap, length_at), READONLY,
     "Offset of the u16 length a routed datagram must agree with (-1: none)."},
    {"max_size", T_INT, offsetof(RouteTap, max_size), READONLY,
     "Larger datagrams are dropped and counted as malformed."},
    {"ancillary", T_BOOL, offsetof(RouteTap, ancillary), READONLY,
     "Whether the fallback gets the datagram's control messages (ancdata)."},
    {"sock", T_OBJECT_EX, offsetof(RouteTap, sock), READONLY, "The socket read."},
    {"routes", T_OBJECT_EX, offsetof(RouteTap, routes), READONLY,
     "The route table: key -> Route."},
    {"fallback", T_OBJECT_EX, offsetof(RouteTap, fallback), READONLY,
     "callable(data, (host, port)[, ancdata]) for datagrams without a route."},
    COUNTER_MEMBERS(RouteTap),
    {NULL},
};

static PyTypeObject RouteTapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.RouteTap",
    .tp_basicsize = sizeof(RouteTap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A socket forwarded by a route table (see dataplane.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RouteTap_init,
    .tp_dealloc = (destructor)RouteTap_dealloc,
    .tp_traverse = (traverseproc)RouteTap_traverse,
    .tp_clear = (inquiry)RouteTap_clear,
    .tp_methods = RouteTap_methods,
    .tp_members = RouteTap_members,
    .tp_dictoffset = offsetof(RouteTap, dict),
};

/* ------------------------------------------------------------ Poller */

/* One epoll set holding every relay socket (and the listening sockets the
 * taps read themselves). The event loop watches only the epoll fd: one
 * wakeup, one Python-level call, then poll() drains every ready socket in C.
 * With one relay socket per allocation this replaces one event-loop callback
 * per socket per datagram. Level-triggered: a socket left with data (the
 * MAX_ROUNDS cap) keeps the epoll fd readable for the next loop turn. */
#include <sys/epoll.h>
#include <unistd.h>

#define POLL_EVENTS 128

typedef struct {
    PyObject_HEAD
    int epfd;
    PyObject *taps; /* dict fd -> tap (keeps them alive while registered) */
    unsigned long long wakeups;
    unsigned long long events;
} Poller;

static struct epoll_event pevents[POLL_EVENTS];

static int
Poller_init(Poller *self, PyObject *args, PyObject *kwds)
{
    if (self->epfd >= 0)
        return 0;
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (self->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->taps = PyDict_New();
    return self->taps ? 0 : -1;
}

static PyObject *
Poller_register(Poller *self, PyObject *args)
{
    int fd;
    PyObject *tap;
    if (!PyArg_ParseTuple(args, "iO", &fd, &tap))
        return NULL;
    if (!PyObject_TypeCheck(tap, &RelayTapType) &&
        !PyObject_TypeCheck(tap, &ListenerTapType) &&
        !PyObject_TypeCheck(tap, &RouteTapType)) {
        PyErr_SetString(PyExc_TypeError,
                        "tap must be a RelayTap, ListenerTap or RouteTap");
        return NULL;
    }
    if (self->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "poller is closed");
        return NULL;
    }
    PyObject *key = PyLong_FromLong(fd);
    if (key == NULL || PyDict_SetItem(self->taps, key, tap) < 0) {
        Py_XDECREF(key);
        return NULL;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.ptr = tap; /* borrowed: self->taps holds the reference */
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        PyDict_DelItem(self->taps, key);
        Py_DECREF(key);
        return NULL;
    }
    Py_DECREF(key);
    Py_RETURN_NONE;
}

static PyObject *
Poller_unregister(Poller *self, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (fd < 0 && PyErr_Occurred())
        return NULL;
    if (self->epfd >= 0)
        epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, NULL);
    /* Events already fetched for this fd cannot be pending: poll() runs
     * them before returning to Python. */
    if (PyDict_DelItem(self->taps, arg) < 0)
        PyErr_Clear();
    Py_RETURN_NONE;
}

static PyObject *
Poller_poll(Poller *self, PyObject *unused)
{
    if (self->epfd < 0)
        Py_RETURN_NONE;
    int n;
    do {
        n = epoll_wait(self->epfd, pevents, POLL_EVENTS, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0)
        Py_RETURN_NONE;
    self->wakeups += 1;
    self->events += (unsigned long long)n;
    /* Hold every tap of this batch: a fallback may unregister (and free) a
     * tap whose event is still in pevents. */
    PyObject *held[POLL_EVENTS];
    for (int i = 0; i < n; i++) {
        held[i] = (PyObject *)pevents[i].data.ptr;
        Py_INCREF(held[i]);
    }
    PyObject *failed = NULL;
    for (int i = 0; i < n && failed == NULL; i++) {
        PyObject *tap = held[i];
        PyObject *result;
        if (PyObject_TypeCheck(tap, &RelayTapType)) {
            RelayTap *relay = (RelayTap *)tap;
            if (relay->fd < 0 || relay->peer_channels == NULL || relay->fallback == NULL)
                continue;
            relay->skip = 0;
            result = relay_drain(relay);
        } else if (PyObject_TypeCheck(tap, &RouteTapType)) {
            RouteTap *routed = (RouteTap *)tap;
            if (routed->fd < 0)
                continue;
            result = route_drain(routed);
        } else {
            ListenerTap *listener = (ListenerTap *)tap;
            if (listener->fd < 0 || listener->clients == NULL || listener->fallback == NULL)
                continue;
            listener->skip = 0;
            result = listener_drain(listener);
        }
        if (result == NULL)
            failed = tap;
        else
            Py_DECREF(result);
    }
    for (int i = 0; i < n; i++)
        Py_DECREF(held[i]);
    if (failed != NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Poller_fileno(Poller *self, PyObject *unused)
{
    return PyLong_FromLong(self->epfd);
}

static PyObject *
Poller_close(Poller *self, PyObject *unused)
{
    if (self->epfd >= 0) {
        close(self->epfd);
        self->epfd = -1;
    }
    if (self->taps != NULL)
        PyDict_Clear(self->taps);
    Py_RETURN_NONE;
}

static int
Poller_traverse(Poller *self, visitproc visit, void *arg)
{
    Py_VISIT(self->taps);
    return 0;
}

static int
Poller_clear(Poller *self)
{
    Py_CLEAR(self->taps);
    return 0;
}

static void
Poller_dealloc(Poller *self)
{
    PyObject_GC_UnTrack(self);
    if (self->epfd >= 0)
        close(self->epfd);
    Poller_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Poller_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Poller *self = (Poller *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->epfd = -1;
    return (PyObject *)self;
}

static PyMethodDef Poller_methods[] = {
    {"register", (PyCFunction)Poller_register, METH_VARARGS,
     "register(fd, tap): drain `fd` with `tap` (RelayTap, ListenerTap, RouteTap)."},
    {"unregister", (PyCFunction)Poller_unregister, METH_O, "unregister(fd)."},
    {"poll", (PyCFunction)Poller_poll, METH_NOARGS,
     "Drain every ready socket (for loop.add_reader(poller.fileno(), poller.poll))."},
    {"fileno", (PyCFunction)Poller_fileno, METH_NOARGS, "The epoll fd."},
    {"close", (PyCFunction)Poller_close, METH_NOARGS, "Close the epoll fd."},
    {NULL},
};

static PyMemberDef Poller_members[] = {
    {"wakeups", T_ULONGLONG, offsetof(Poller, wakeups), READONLY,
     "poll() calls that found ready sockets."},
    {"events", T_ULONGLONG, offsetof(Poller, events), READONLY,
     "Ready sockets handled."},
    {NULL},
};

static PyTypeObject PollerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.Poller",
    .tp_basicsize = sizeof(Poller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An epoll set of data-plane sockets (TURN and route taps), drained in C.",
    .tp_new = Poller_new,
    .tp_init = (initproc)Poller_init,
    .tp_dealloc = (destructor)Poller_dealloc,
    .tp_traverse = (traverseproc)Poller_traverse,
    .tp_clear = (inquiry)Poller_clear,
    .tp_methods = Poller_methods,
    .tp_members = Poller_members,
};

/* ------------------------------------------------------------ module */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "crossroads.transport._turnfast",
    .m_doc = "TURN UDP data plane (recvmmsg/sendmmsg); see turnplane.py.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__turnfast(void)
{
    if (PyType_Ready(&RelayTapType) < 0 || PyType_Ready(&ListenerTapType) < 0 ||
        PyType_Ready(&ChannelRouterType) < 0 || PyType_Ready(&PollerType) < 0 ||
        PyType_Ready(&RouteType) < 0 || PyType_Ready(&RouteTapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RelayTapType);
    if (PyModule_AddObject(m, "RelayTap", (PyObject *)&RelayTapType) < 0) {
        Py_DECREF(&RelayTapType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ListenerTapType);
    if (PyModule_AddObject(m, "ListenerTap", (PyObject *)&ListenerTapType) < 0) {
        Py_DECREF(&ListenerTapType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ChannelRouterType);
    if (PyModule_AddObject(m, "ChannelRouter", (PyObject *)&ChannelRouterType) < 0) {
        Py_DECREF(&ChannelRouterType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PollerType);
    if (PyModule_AddObject(m, "Poller", (PyObject *)&PollerType) < 0) {
        Py_DECREF(&PollerType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Route", (PyObject *)&RouteType) < 0 ||
        PyModule_AddObjectRef(m, "RouteTap", (PyObject *)&RouteTapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
