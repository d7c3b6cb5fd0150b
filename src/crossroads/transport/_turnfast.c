/*
 * crossroads.transport._turnfast — the relay data plane in C.
 *
 * Optional accelerator for crossroads/transport/dataplane.py, which holds the
 * pure-Python twin of exactly the same behaviour (used when this module is
 * not built, or with CROSSROADS_TURN_PURE_PYTHON=1). See that file for the
 * design; in short:
 *
 *   Route     where a datagram goes: an out socket, a destination, an
 *             optional control message, an optional header rewrite (TURN's
 *             ChannelData header off client->peer, on peer->client) and an
 *             optional Budget (a token bucket shared by an allocation's
 *             routes). It counts packets and octets.
 *   RouteTap  one socket read with recvmmsg; each datagram's key (source
 *             address, or address + first `prefix` bytes) is looked up in
 *             the control plane's dict of Routes; routed datagrams leave
 *             with sendmmsg (iovecs into the receive buffers, no copy), the
 *             rest go to `fallback(data, addr)` in arrival order. A tap
 *             without a socket takes datagrams handed in by a reader that
 *             is not ours (`datagram_received`: TCP, DTLS, asyncio).
 *   Budget    bytes/s token bucket (TURN's --turn-max-bps).
 *   Poller    one epoll set of taps, one event-loop fd for all of them.
 *
 * Why C: per packet, asyncio/uvloop costs one wakeup, one Python callback
 * and one syscall per direction. Here one wakeup drains every ready socket
 * in batches of RECV_BATCH, and the only Python object per datagram is its
 * (cached) address tuple.
 *
 * Batching the sends: the receive buffers are an arena of ARENA slots, more
 * than one batch, and what is routed waits in one send queue shared by every
 * tap. One wakeup (Poller.poll, or a tap's readable()) reads every ready
 * socket into fresh slots, then flushes the queue once, one sendmmsg per
 * outgoing socket with that socket's datagrams in arrival order (a flow
 * always leaves by one socket, so its order holds). TURN needs this: each
 * allocation's peers arrive on its own relay socket but all leave by the
 * one listening socket, and a client's ChannelData arrives on the listening
 * socket interleaved across allocations but leaves by each relay socket; a
 * flush per socket drained or per change of outgoing socket made those a
 * sendmmsg of a few datagrams each. The queue is flushed early only when
 * the arena has no room for one more batch, before any Python code runs (a
 * fallback: it may send, close or reroute, and must see what came before it
 * already sent), and before a datagram handed in as a bytes object goes away.
 *
 * Everything runs on the event loop thread with the GIL held; the static
 * buffers are safe because no Python code runs while the queue holds
 * anything (fallback calls happen after a flush; every entry point flushes
 * before it returns).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* recvmmsg batch (the measured knee of batching is ~8-32, reference §5.2). */
#define RECV_BATCH 32
/* At most this many batches per wakeup, so one busy socket cannot starve
 * the event loop. */
#define MAX_ROUNDS 8
/* Largest UDP payload. */
#define SLOT 65536
/* Receive slots: what one tap reads at most in one wakeup (MAX_ROUNDS
 * batches), so that a wakeup's sends wait for one flush. 16 MiB of address
 * space; the kernel maps a page only when a datagram is written to it (one
 * page per slot for game-sized datagrams). */
#define ARENA (MAX_ROUNDS * RECV_BATCH)

static unsigned char rbuf[ARENA][SLOT];
static struct mmsghdr rmsg[ARENA];
static struct iovec riov[ARENA];
static struct sockaddr_storage raddr[ARENA];
/* Slots [0, arena_used) hold datagrams read since the queue was last empty. */
static int arena_used;

/* Header written in front of the data (ChannelData: 4 bytes; a Data
 * indication: 20-byte STUN header, XOR-PEER-ADDRESS of up to 24 bytes, the
 * DATA attribute's 4-byte header), the data, and padding. */
#define MAX_HEADER 48
/* The send queue: a routed datagram of each arena slot, or one handed in
 * (datagram_received, flushed at once). */
#define QUEUE ARENA
static struct mmsghdr smsg[QUEUE];
static struct iovec siov[QUEUE][3];
static unsigned char shdr[QUEUE][MAX_HEADER];
/* The payload bytes each queued datagram counts for. */
static size_t spayload[QUEUE];
/* Per-datagram destinations (a Send indication names its peer). */
static struct sockaddr_storage sdest[QUEUE];
/* Its outgoing fd, its route (held: msg_name may point into it) and the tap
 * whose counters it goes to (held). */
static int sfd[QUEUE];
static PyObject *sroute[QUEUE];
static PyObject *stap[QUEUE];
static int queued;
/* One outgoing fd's share of the queue, in order, and where each came from. */
static struct mmsghdr sbatch[QUEUE];
static int sorigin[QUEUE];
/* sendmmsg calls made (Poller.sends is its growth during poll()). */
static unsigned long long sendmmsg_calls;
static const unsigned char zeros[4];
/* Set while a tap iterates over arena slots: a nested tap call (a fallback
 * that somehow re-enters) must not recvmmsg into the buffers being read. */
static int draining;
static void gso_set_fd(int fd, int allowed);

/* ------------------------------------------------------------ type boilerplate */

/* Every type here holds a few Python references; these write the GC
 * traverse/clear/dealloc trio from one list of fields:
 *   #define ROUTE_REFS(X) X(sock) X(dest)
 *   GC_FUNCTIONS(Route, ROUTE_REFS)                                        */
#define VISIT_REF(field) Py_VISIT(self->field);
#define CLEAR_REF(field) Py_CLEAR(self->field);
#define GC_FUNCTIONS(Type, REFS)                                               \
    static int Type##_traverse(Type *self, visitproc visit, void *arg)         \
    {                                                                          \
        REFS(VISIT_REF)                                                        \
        return 0;                                                              \
    }                                                                          \
    static int Type##_clear(Type *self)                                        \
    {                                                                          \
        REFS(CLEAR_REF)                                                        \
        return 0;                                                              \
    }                                                                          \
    static void Type##_dealloc(Type *self)                                     \
    {                                                                          \
        PyObject_GC_UnTrack(self);                                             \
        Type##_release(self);                                                  \
        Type##_clear(self);                                                    \
        Py_TYPE(self)->tp_free((PyObject *)self);                              \
    }

/* The type object of `Type`, with its Type_init/_methods/_members. */
#define TYPE_OBJECT(Type, doc, new_func)                                       \
    {                                                                          \
        PyVarObject_HEAD_INIT(NULL, 0)                                         \
        .tp_name = "crossroads.transport._turnfast." #Type,                   \
        .tp_basicsize = sizeof(Type),                                          \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,                   \
        .tp_doc = doc,                                                         \
        .tp_new = new_func,                                                    \
        .tp_init = (initproc)Type##_init,                                      \
        .tp_dealloc = (destructor)Type##_dealloc,                              \
        .tp_traverse = (traverseproc)Type##_traverse,                          \
        .tp_clear = (inquiry)Type##_clear,                                     \
        .tp_methods = Type##_methods,                                          \
        .tp_members = Type##_members,                                          \
    }

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

/* One read-only counter member of a tap. */
#define COUNTER(Type, name, doc) \
    {#name, T_ULONGLONG, offsetof(Type, c.name), READONLY, doc}
#define COUNTER_MEMBERS(Type)                                                   \
    COUNTER(Type, forwarded, "Datagrams forwarded in C."),                     \
    COUNTER(Type, forwarded_bytes, "Payload bytes forwarded in C."),           \
    COUNTER(Type, send_errors, "Sends that failed (dropped)."),                \
    COUNTER(Type, malformed,                                                   \
            "Truncated, padded-too-much or oversized datagrams dropped."),     \
    COUNTER(Type, batches, "recvmmsg calls that returned datagrams."),         \
    COUNTER(Type, drained,                                                     \
            "Datagrams read by recvmmsg (beyond those the event loop delivered)."), \
    COUNTER(Type, throttled,                                                   \
            "Datagrams dropped by their route's Budget (bandwidth limit)."),   \
    COUNTER(Type, sends,                                                       \
            "sendmmsg calls that carried this tap's datagrams (one carrying "  \
            "several taps' counts on each).")

#define COUNTER_FIELDS            \
    unsigned long long forwarded; \
    unsigned long long forwarded_bytes; \
    unsigned long long send_errors; \
    unsigned long long malformed; \
    unsigned long long batches;   \
    unsigned long long drained;   \
    unsigned long long throttled; \
    unsigned long long sends

typedef struct {
    COUNTER_FIELDS;
} Counters;

/* ------------------------------------------------------------ Budget */

/* A bandwidth limit in bytes/s (TURN's --turn-max-bps, both directions of an
 * allocation's relay): a token bucket holding at most one second's worth,
 * refilled from CLOCK_MONOTONIC (the clock of Python's time.monotonic, which
 * the twin uses). Shared by every route of the relay. */
typedef struct {
    PyObject_HEAD
    double bps, tokens, stamp;
    unsigned long long throttled;
} Budget;

static PyTypeObject BudgetType;

/* Whether `size` more bytes fit the budget now (else counted as throttled). */
static int
budget_ok(Budget *b, size_t size)
{
    if (b->bps <= 0)
        return 1;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    double tokens = b->tokens + (now - b->stamp) * b->bps;
    if (tokens > b->bps)
        tokens = b->bps;
    b->stamp = now;
    if (tokens < (double)size) {
        b->tokens = tokens;
        b->throttled += 1;
        return 0;
    }
    b->tokens = tokens - (double)size;
    return 1;
}

static int
Budget_init(Budget *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"bps", NULL};
    double bps = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", names, &bps))
        return -1;
    self->bps = bps;
    return 0;
}

static PyObject *
Budget_allow(Budget *self, PyObject *arg)
{
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "size must be >= 0");
        return NULL;
    }
    return PyBool_FromLong(budget_ok(self, (size_t)size));
}

static PyMethodDef Budget_methods[] = {
    {"allow", (PyCFunction)Budget_allow, METH_O,
     "allow(size): spend `size` bytes of the budget (False: drop it)."},
    {NULL},
};

static PyMemberDef Budget_members[] = {
    {"bps", T_DOUBLE, offsetof(Budget, bps), 0, "Bytes per second (0: no limit)."},
    {"throttled", T_ULONGLONG, offsetof(Budget, throttled), READONLY,
     "Datagrams refused for want of budget."},
    {NULL},
};

static PyTypeObject BudgetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crossroads.transport._turnfast.Budget",
    .tp_basicsize = sizeof(Budget),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Budget(bps): a token bucket of bytes/s shared by routes.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Budget_init,
    .tp_methods = Budget_methods,
    .tp_members = Budget_members,
};

/* ------------------------------------------------------------ helpers */

/* Ready slots [base, base + RECV_BATCH) for a recvmmsg (it overwrites the
 * lengths). */
static void
prepare_recv(int base)
{
    for (int i = base; i < base + RECV_BATCH; i++) {
        riov[i].iov_base = rbuf[i];
        riov[i].iov_len = SLOT;
        memset(&rmsg[i].msg_hdr, 0, sizeof(rmsg[i].msg_hdr));
        rmsg[i].msg_hdr.msg_name = &raddr[i];
        rmsg[i].msg_hdr.msg_namelen = sizeof(raddr[i]);
        rmsg[i].msg_hdr.msg_iov = &riov[i];
        rmsg[i].msg_hdr.msg_iovlen = 1;
    }
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

/* ------------------------------------------------------------ Route */

/* The generic half of the data plane: a socket whose datagrams are forwarded
 * by a route table the control plane writes (see dataplane.py for the design
 * and the pure-Python twin). The key is the source (host, port), or
 * ((host, port), first `prefix` bytes) when a protocol names its route in a
 * header (the Unity relay's RELAY frame; TURN's ChannelData channel number).
 * The value is a Route: an out socket, a destination, the route's counters
 * and what it does to the datagram on the way. What has no route goes to
 * `fallback(data, addr)`. */

/* Largest control message a route sends with: in6_pktinfo is 20 bytes
 * (ipv6(7)), in_pktinfo 12 (ip(7)) -- the source address of a reply on a
 * wildcard bind (pktinfo.py). */
#define ROUTE_CONTROL 20
/* Room for the control messages a tap receives (both pktinfo options may be
 * on for a dual-stack socket; pktinfo.ANCILLARY_BYTES). */
#define TAP_CONTROL 128

/* What a route does to a datagram (dataplane.Rewrite). */
enum {
    /* Forward unchanged. */
    REWRITE_NONE = 0,
    /* A ChannelData message from a TURN client: check its length field and
     * send the application data alone (RFC 8656 §12.5: shorter than
     * claimed is malformed; up to 3 bytes of padding may follow). */
    REWRITE_UNWRAP_CHANNEL = 1,
    /* Data from a TURN peer: prepend the ChannelData header (channel number,
     * length; RFC 8656 §12.4). Over UDP no padding (§12.5). */
    REWRITE_WRAP_CHANNEL = 2,
    /* Data from a TURN peer without a channel: a Data indication (RFC 8656
     * §11.6: STUN header with a fresh transaction id, XOR-PEER-ADDRESS,
     * DATA padded to 4 bytes), as proto/turn/fastpath.py writes it. */
    REWRITE_DATA_INDICATION = 3,
    /* A Send indication from a TURN client (RFC 8656 §11.4): its DATA goes
     * to its XOR-PEER-ADDRESS when that IP has a permission (the route's
     * `permissions` dict), is not one `refuse` names (the service's own
     * hosts: the control plane judges those per port; `approved` maps the
     * (host, port) it approved to a CLOCK_MONOTONIC deadline) and is of the out
     * socket's family. Anything unusual -- another attribute, a repeated
     * one, a bad FINGERPRINT, lengths that disagree -- is not forwarded
     * but handed to the fallback (the full STUN codec), as
     * fastpath.parse_send_indication does. */
    REWRITE_UNWRAP_SEND = 4,
};
/* RFC 8489 §5 magic cookie, §14.7 FINGERPRINT XOR. */
#define MAGIC_COOKIE 0x2112A442u
#define FINGERPRINT_XOR 0x5354554Eu
#define STUN_HEADER 20
#define SEND_INDICATION 0x0016
#define DATA_INDICATION 0x0017
#define ATTR_XOR_PEER_ADDRESS 0x0012
#define ATTR_DATA 0x0013
#define ATTR_DONT_FRAGMENT 0x001A
#define ATTR_FINGERPRINT 0x8028

static uint32_t crc_table[256];

static void
crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* CRC-32 (ISO 3309, zlib's), for FINGERPRINT (RFC 8489 §14.7). */
static uint32_t
crc32_of(const unsigned char *buf, size_t size)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < size; i++)
        c = crc_table[(c ^ buf[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}
/* ChannelData header: channel number (2 bytes) and length (2 bytes). */
#define CHANNEL_HEADER 4
/* RFC 8656 §12.5: at most 3 bytes of padding after the application data. */
#define CHANNEL_MAX_PADDING 3

static unsigned char rctl[ARENA][TAP_CONTROL];
static unsigned char sctl[QUEUE][CMSG_SPACE(ROUTE_CONTROL)];

typedef struct {
    PyObject_HEAD
    int out_fd;
    struct sockaddr_storage dest_sa;
    socklen_t dest_salen;
    PyObject *sock; /* the out socket: kept alive while the route exists */
    PyObject *dest; /* (host, port) */
    PyObject *control; /* None, or (level, type, data): sendmsg ancillary data */
    PyObject *budget;  /* None, or a Budget */
    PyObject *peer;    /* DATA_INDICATION: the peer (host, port), else None */
    PyObject *permissions; /* UNWRAP_SEND: dict peer host -> permission */
    PyObject *refuse;      /* UNWRAP_SEND: None, or set of hosts for the fallback */
    PyObject *approved;    /* UNWRAP_SEND: None, or dict (host, port) -> deadline */
    int out_family;
    /* DATA_INDICATION: the peer's address and port (network order), the
     * transaction id's random 8 bytes and a counter for the last 4. */
    int peer_family;
    unsigned char peer_addr[16];
    unsigned char peer_port[2];
    unsigned char txid[12];
    uint32_t txid_counter;
    int clevel, ctype;
    unsigned char cdata[ROUTE_CONTROL];
    size_t clen;
    int rewrite;
    int channel;
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
    static char *names[] = {"sock", "dest", "control", "rewrite", "channel",
                            "budget", "peer", "txid", "permissions", "refuse",
                            "approved", NULL};
    PyObject *sock, *dest, *control = Py_None, *budget = Py_None, *peer = Py_None;
    PyObject *permissions = Py_None, *refuse = Py_None, *approved = Py_None;
    const char *txid = NULL;
    Py_ssize_t txid_len = 0;
    int rewrite = REWRITE_NONE, channel = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$iiOOy#OOO", names, &sock, &dest,
                                     &control, &rewrite, &channel, &budget, &peer,
                                     &txid, &txid_len, &permissions, &refuse, &approved))
        return -1;
    if (rewrite < REWRITE_NONE || rewrite > REWRITE_UNWRAP_SEND ||
        channel < 0 || channel > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "rewrite or channel out of range");
        return -1;
    }
    if (rewrite == REWRITE_DATA_INDICATION) {
        struct sockaddr_storage ss;
        socklen_t sslen;
        if (txid_len != 8 || sockaddr_from_tuple(peer, &ss, &sslen) < 0) {
            PyErr_SetString(PyExc_ValueError,
                            "a Data indication route needs peer=(ip, port), txid=8 bytes");
            return -1;
        }
        self->peer_family = ss.ss_family;
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
            memcpy(self->peer_addr, &v4->sin_addr, 4);
            memcpy(self->peer_port, &v4->sin_port, 2);
        } else {
            struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
            memcpy(self->peer_addr, &v6->sin6_addr, 16);
            memcpy(self->peer_port, &v6->sin6_port, 2);
        }
        memcpy(self->txid, txid, 8);
        self->txid_counter = 0;
        Py_XSETREF(self->peer, PyTuple_GetSlice(peer, 0, 2));
        if (self->peer == NULL)
            return -1;
    }
    if (rewrite == REWRITE_UNWRAP_SEND) {
        if (!PyDict_Check(permissions) || (refuse != Py_None && !PyAnySet_Check(refuse)) ||
            (approved != Py_None && !PyDict_Check(approved))) {
            PyErr_SetString(PyExc_TypeError, "a Send route needs permissions=dict, "
                                             "refuse=set or None, approved=dict or None");
            return -1;
        }
        Py_XSETREF(self->permissions, Py_NewRef(permissions));
        Py_XSETREF(self->refuse, refuse == Py_None ? NULL : Py_NewRef(refuse));
        Py_XSETREF(self->approved, approved == Py_None ? NULL : Py_NewRef(approved));
    }
    if (budget != Py_None && !PyObject_TypeCheck(budget, &BudgetType)) {
        PyErr_SetString(PyExc_TypeError, "budget must be a Budget or None");
        return -1;
    }
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
    struct sockaddr_storage local;
    socklen_t local_len = sizeof(local);
    if (getsockname(fd, (struct sockaddr *)&local, &local_len) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->out_family = local.ss_family;
    if (dest == Py_None && rewrite == REWRITE_UNWRAP_SEND) {
        /* Each Send indication names its own destination. */
        self->dest_salen = 0;
        Py_XSETREF(self->dest, Py_NewRef(Py_None));
    } else if (sockaddr_from_tuple(dest, &self->dest_sa, &self->dest_salen) < 0) {
        PyErr_SetString(PyExc_ValueError, "dest must be (ip, port)");
        return -1;
    }
    self->out_fd = fd;
    /* A new route may take another path (another MTU, another device):
     * GSO gets another try on its socket (see "UDP GSO" below). */
    gso_set_fd(fd, 1);
    self->rewrite = rewrite;
    self->channel = channel;
    Py_XSETREF(self->sock, Py_NewRef(sock));
    Py_XSETREF(self->budget, budget == Py_None ? NULL : Py_NewRef(budget));
    if (dest != Py_None) {
        PyObject *key = PyTuple_GetSlice(dest, 0, 2);
        if (key == NULL)
            return -1;
        Py_XSETREF(self->dest, key);
    }
    return 0;
}

static void
Route_release(Route *self)
{
}

#define ROUTE_REFS(X) \
    X(sock) X(dest) X(control) X(budget) X(peer) X(permissions) X(refuse) X(approved)
GC_FUNCTIONS(Route, ROUTE_REFS)

static PyMethodDef Route_methods[] = {
    {NULL},
};

static PyMemberDef Route_members[] = {
    {"sock", T_OBJECT_EX, offsetof(Route, sock), READONLY, "The socket it leaves from."},
    {"dest", T_OBJECT_EX, offsetof(Route, dest), READONLY, "(host, port) it goes to."},
    {"control", T_OBJECT_EX, offsetof(Route, control), READONLY,
     "None, or the (level, type, data) control message sent with each datagram."},
    {"budget", T_OBJECT, offsetof(Route, budget), READONLY,
     "None, or the Budget it spends."},
    {"peer", T_OBJECT, offsetof(Route, peer), READONLY,
     "The peer a Data indication names (None for other rewrites)."},
    {"permissions", T_OBJECT, offsetof(Route, permissions), READONLY,
     "A Send route's permission table (peer host -> permission)."},
    {"refuse", T_OBJECT, offsetof(Route, refuse), READONLY,
     "A Send route's hosts left to the fallback..."},
    {"approved", T_OBJECT, offsetof(Route, approved), READONLY,
     "...but for these (host, port): monotonic deadline of the fallback's approval."},
    {"rewrite", T_INT, offsetof(Route, rewrite), READONLY,
     "What it does to a datagram (dataplane.Rewrite)."},
    {"channel", T_INT, offsetof(Route, channel), READONLY,
     "The channel number a WRAP_CHANNEL route puts in front."},
    {"packets", T_ULONGLONG, offsetof(Route, packets), 0,
     "Datagrams that took this route (sent or not)."},
    {"octets", T_ULONGLONG, offsetof(Route, octets), 0,
     "Bytes of those datagrams (the application data, without a rewritten header)."},
    {NULL},
};

static PyTypeObject RouteType = TYPE_OBJECT(
    Route, "Route(sock, dest[, control], *, rewrite=0, channel=0, budget=None).",
    PyType_GenericNew);

/* ------------------------------------------------------------ RouteTap */

/* Longest key prefix (the Unity relay's is 36 bytes). */
#define MAX_PREFIX 64

typedef struct {
    PyObject_HEAD
    int fd;
    int prefix;      /* bytes of the datagram in the key; 0: the address alone */
    int length_at;   /* -1, or offset of a u16 BE that must equal the rest's size */
    int max_size;    /* larger datagrams are dropped as malformed */
    char ancillary;  /* receive control messages, hand them to the fallback */
    PyObject *sock;     /* None: a tap that only takes datagrams handed in */
    PyObject *routes;   /* dict key -> Route */
    PyObject *fallback; /* callable(data, (host, port)) */
    Counters c;
    /* The sendmmsg call (sendmmsg_calls) last counted in c.sends. */
    unsigned long long last_send;
} RouteTap;

static PyTypeObject RouteTapType;

/* Count the latest sendmmsg call in `tap`'s sends, once per call. */
static void
count_call(RouteTap *tap)
{
    if (tap->last_send != sendmmsg_calls) {
        tap->last_send = sendmmsg_calls;
        tap->c.sends += 1;
    }
}

/* Count `sent` datagrams of sbatch[first...] as forwarded, on their taps. */
static void
count_sent(int first, int sent)
{
    for (int k = first; k < first + sent; k++) {
        int i = sorigin[k];
        RouteTap *tap = (RouteTap *)stap[i];
        tap->c.forwarded += 1;
        tap->c.forwarded_bytes += spayload[i];
        count_call(tap);
    }
}

/* ------------------------------------------------------------ UDP GSO
 *
 * A burst of datagrams to one destination (a game server's tick fanned out
 * to one client through the listening socket, a client's ChannelData to one
 * peer) leaves as one message with UDP_SEGMENT (Linux >= 4.18,
 * udp(7)): the stack walks its send path once for the whole run and cuts it
 * into datagrams of `gso_size` at the device (or in software just before
 * it), as coturn does since 4.12.
 * A run is consecutive datagrams of one outgoing socket's batch (so order
 * holds) with the same destination, the same control message and the same
 * size; the last one may be shorter (net/ipv4/udp.c cuts every segment
 * but the last at gso_size). The receiver sees the same datagrams as without GSO.
 *
 * A kernel or device that refuses (EIO: no checksum offload on the route's
 * device; EMSGSIZE or EINVAL: a segment over the device MTU; ENOPROTOOPT or
 * EINVAL: a kernel without UDP_SEGMENT) gets the run again datagram by
 * datagram, and GSO stays off for that socket until a new Route or RouteTap
 * is made on it (a new route may take a path that segments: one refused
 * call per new route at most). */
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
/* UDP_MAX_SEGMENTS of include/linux/udp.h: 64 since 4.18 (newer kernels
 * allow 128; 64 is taken everywhere). */
#define GSO_MAX_SEGMENTS 64
/* The kernel refuses a segment that does not fit the path MTU with its
 * headers (EINVAL, udp_send_skb). 1452 = 1500 (Ethernet) - 40 (IPv6) - 8
 * (UDP): larger datagrams (rare in games, reference §5.2) go alone, so a
 * burst of them cannot switch GSO off for the socket. */
#define GSO_MAX_SEGMENT 1452
/* One GSO message is one IP datagram before segmentation: its length field
 * is 16 bits (65535 with headers). */
#define GSO_MAX_BYTES 65000
/* Sockets whose fd is above this go without GSO (the refusal bitmap). */
#define GSO_FDS 65536

static int gso_enabled = 1;
static unsigned char gso_off[GSO_FDS / 8];
static unsigned long long gso_sends, gso_segments, gso_refused;
static struct mmsghdr gmsg[QUEUE];
static struct iovec giov[QUEUE * 3];
static int gfirst[QUEUE], gcount[QUEUE];
static union {
    struct cmsghdr align;
    unsigned char buf[CMSG_SPACE(ROUTE_CONTROL) + CMSG_SPACE(sizeof(uint16_t))];
} gctl[QUEUE];

static int
gso_allowed(int fd)
{
    return gso_enabled && fd >= 0 && fd < GSO_FDS && !(gso_off[fd >> 3] & (1u << (fd & 7)));
}

static void
gso_set_fd(int fd, int allowed)
{
    if (fd < 0 || fd >= GSO_FDS)
        return;
    if (allowed)
        gso_off[fd >> 3] &= (unsigned char)~(1u << (fd & 7));
    else
        gso_off[fd >> 3] |= (unsigned char)(1u << (fd & 7));
}

static size_t
msg_size(const struct msghdr *h)
{
    size_t size = 0;
    for (size_t k = 0; k < h->msg_iovlen; k++)
        size += h->msg_iov[k].iov_len;
    return size;
}

static int
same_path(const struct msghdr *a, const struct msghdr *b)
{
    return a->msg_namelen == b->msg_namelen &&
           memcmp(a->msg_name, b->msg_name, a->msg_namelen) == 0 &&
           a->msg_controllen == b->msg_controllen &&
           (a->msg_controllen == 0 ||
            memcmp(a->msg_control, b->msg_control, a->msg_controllen) == 0);
}

/* Group sbatch[start, count) into gmsg: each run (see above) becomes one
 * message with a UDP_SEGMENT control message, anything else stays as it is.
 * gfirst/gcount say which datagrams of sbatch each message carries.
 * Returns the number of messages. */
static int
gso_group(int start, int count)
{
    int n = 0;
    size_t iov_used = 0;
    int i = start;
    while (i < count) {
        struct msghdr *h = &sbatch[i].msg_hdr;
        size_t seg = msg_size(h);
        size_t total = seg;
        int j = i + 1;
        if (seg > 0 && seg <= GSO_MAX_SEGMENT) {
            while (j < count && j - i < GSO_MAX_SEGMENTS) {
                struct msghdr *o = &sbatch[j].msg_hdr;
                size_t size = msg_size(o);
                if (size == 0 || size > seg || total + size > GSO_MAX_BYTES || !same_path(h, o))
                    break;
                total += size;
                j++;
                if (size < seg)
                    break; /* a shorter datagram ends the run */
            }
        }
        gfirst[n] = i;
        gcount[n] = j - i;
        if (j - i == 1) {
            gmsg[n] = sbatch[i];
        } else {
            struct msghdr *g = &gmsg[n].msg_hdr;
            memset(&gmsg[n], 0, sizeof(gmsg[n]));
            g->msg_name = h->msg_name;
            g->msg_namelen = h->msg_namelen;
            g->msg_iov = &giov[iov_used];
            for (int k = i; k < j; k++) {
                struct msghdr *o = &sbatch[k].msg_hdr;
                memcpy(&giov[iov_used], o->msg_iov, o->msg_iovlen * sizeof(struct iovec));
                iov_used += o->msg_iovlen;
            }
            g->msg_iovlen = (size_t)(&giov[iov_used] - g->msg_iov);
            unsigned char *ctl = gctl[n].buf;
            memset(ctl, 0, sizeof(gctl[n].buf));
            if (h->msg_controllen)
                memcpy(ctl, h->msg_control, h->msg_controllen);
            struct cmsghdr *c = (struct cmsghdr *)(void *)(ctl + h->msg_controllen);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso_size = (uint16_t)seg;
            memcpy(CMSG_DATA(c), &gso_size, sizeof(gso_size));
            g->msg_control = ctl;
            g->msg_controllen = h->msg_controllen + CMSG_SPACE(sizeof(uint16_t));
        }
        n++;
        i = j;
    }
    return n;
}

/* Send sbatch[start, count) from `fd` datagram by datagram: as many
 * sendmmsg calls as the socket takes (MSG_DONTWAIT may send part of it). */
static void
send_plain(int fd, int start, int count)
{
    while (start < count) {
        int sent = sendmmsg(fd, &sbatch[start], (unsigned int)(count - start), MSG_DONTWAIT);
        sendmmsg_calls += 1;
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent <= 0) {
            /* One failed datagram (a full buffer, an ICMP error pending on
             * the socket) must not take the rest of the batch with it. */
            RouteTap *tap = (RouteTap *)stap[sorigin[start]];
            tap->c.send_errors += 1;
            count_call(tap);
            start += 1;
            continue;
        }
        count_sent(start, sent);
        start += sent;
    }
}

/* Send sbatch[0, count) from `fd`: runs to one destination as GSO messages
 * where the socket allows it, the rest as they are. */
static void
send_batch(int fd, int count)
{
    int start = 0;
    while (start < count) {
        if (!gso_allowed(fd) || count - start < 2) {
            send_plain(fd, start, count);
            return;
        }
        int n = gso_group(start, count);
        if (n == count - start) { /* no run: nothing to gain */
            send_plain(fd, start, count);
            return;
        }
        int m = 0;
        int refused = 0;
        while (m < n) {
            int sent = sendmmsg(fd, &gmsg[m], (unsigned int)(n - m), MSG_DONTWAIT);
            sendmmsg_calls += 1;
            if (sent < 0 && errno == EINTR)
                continue;
            if (sent <= 0) {
                if (gcount[m] > 1 && (errno == EIO || errno == EINVAL || errno == EMSGSIZE ||
                                     errno == ENOPROTOOPT)) {
                    /* The kernel or the device will not segment: this
                     * socket goes without GSO from here on. */
                    gso_set_fd(fd, 0);
                    gso_refused += 1;
                    start = gfirst[m];
                    refused = 1;
                    break;
                }
                RouteTap *tap = (RouteTap *)stap[sorigin[gfirst[m]]];
                tap->c.send_errors += (unsigned long long)gcount[m];
                count_call(tap);
                m += 1;
                continue;
            }
            for (int k = m; k < m + sent; k++) {
                count_sent(gfirst[k], gcount[k]);
                if (gcount[k] > 1) {
                    gso_sends += 1;
                    gso_segments += (unsigned long long)gcount[k];
                }
            }
            m += sent;
        }
        if (!refused)
            return;
    }
}

/* Send everything queued: one sendmmsg (or more, on a partial send) per
 * outgoing fd, each fd's datagrams in the order they were queued. */
static void
flush_sends(void)
{
    int count = queued;
    if (count == 0)
        return;
    char done[QUEUE];
    memset(done, 0, (size_t)count);
    for (int first = 0; first < count; first++) {
        if (done[first])
            continue;
        int fd = sfd[first];
        int n = 0;
        for (int i = first; i < count; i++) {
            if (!done[i] && sfd[i] == fd) {
                done[i] = 1;
                sbatch[n] = smsg[i];
                sorigin[n] = i;
                n++;
            }
        }
        send_batch(fd, n);
    }
    /* Empty before the references go: a deallocation may run Python code,
     * which may queue (and flush) again. */
    PyObject *routes[QUEUE], *taps[QUEUE];
    memcpy(routes, sroute, (size_t)count * sizeof(PyObject *));
    memcpy(taps, stap, (size_t)count * sizeof(PyObject *));
    queued = 0;
    for (int i = 0; i < count; i++) {
        Py_DECREF(routes[i]);
        Py_DECREF(taps[i]);
    }
}

/* The first of RECV_BATCH free arena slots: flushes the queue when the
 * arena has no room left (what is queued points into it). */
static int
arena_take(void)
{
    if (queued && arena_used + RECV_BATCH > ARENA)
        flush_sends();
    if (queued == 0)
        arena_used = 0;
    return arena_used;
}

/* Write the Data indication header for `size` bytes of data into `hdr`;
 * returns its length (RFC 8656 §11.6; the layout of fastpath.data_indication). */
static size_t
data_indication_header(Route *r, unsigned char *hdr, size_t size)
{
    size_t attr = r->peer_family == AF_INET ? 8 : 20;
    size_t pad = (4 - (size & 3)) & 3;
    size_t length = 4 + attr + 4 + size + pad;
    r->txid_counter += 1;
    r->txid[8] = (unsigned char)(r->txid_counter >> 24);
    r->txid[9] = (unsigned char)(r->txid_counter >> 16);
    r->txid[10] = (unsigned char)(r->txid_counter >> 8);
    r->txid[11] = (unsigned char)r->txid_counter;
    unsigned char cookie[4] = {0x21, 0x12, 0xA4, 0x42};
    hdr[0] = DATA_INDICATION >> 8;
    hdr[1] = DATA_INDICATION & 0xFF;
    hdr[2] = (unsigned char)(length >> 8);
    hdr[3] = (unsigned char)length;
    memcpy(hdr + 4, cookie, 4);
    memcpy(hdr + 8, r->txid, 12);
    unsigned char *a = hdr + STUN_HEADER;
    a[0] = 0;
    a[1] = ATTR_XOR_PEER_ADDRESS;
    a[2] = 0;
    a[3] = (unsigned char)attr;
    a[4] = 0;
    a[5] = r->peer_family == AF_INET ? 1 : 2;
    a[6] = r->peer_port[0] ^ 0x21;
    a[7] = r->peer_port[1] ^ 0x12;
    /* XOR with the cookie (IPv4), or the cookie and transaction id (IPv6). */
    for (size_t k = 0; k < attr - 4; k++)
        a[8 + k] = r->peer_addr[k] ^ (k < 4 ? cookie[k] : r->txid[k - 4]);
    unsigned char *d = a + 4 + attr;
    d[0] = 0;
    d[1] = ATTR_DATA;
    d[2] = (unsigned char)(size >> 8);
    d[3] = (unsigned char)size;
    return STUN_HEADER + 4 + attr + 4;
}

/* Queue `size` bytes at `payload` along `route` (to `dest`, or the route's
 * own destination when NULL), with the route's header rewrite. */
static void
route_queue(RouteTap *self, Route *route, const unsigned char *payload, size_t size,
            const struct sockaddr_storage *dest, socklen_t dest_len)
{
    if (queued == QUEUE)
        flush_sends(); /* cannot happen (one entry per arena slot); but safe */
    int i = queued;
    struct iovec *iov = siov[i];
    memset(&smsg[i], 0, sizeof(smsg[i]));
    smsg[i].msg_hdr.msg_iov = iov;
    if (route->rewrite == REWRITE_WRAP_CHANNEL) {
        shdr[i][0] = (unsigned char)(route->channel >> 8);
        shdr[i][1] = (unsigned char)route->channel;
        shdr[i][2] = (unsigned char)(size >> 8);
        shdr[i][3] = (unsigned char)size;
        iov->iov_base = shdr[i];
        iov->iov_len = CHANNEL_HEADER;
        iov++;
    } else if (route->rewrite == REWRITE_DATA_INDICATION) {
        iov->iov_base = shdr[i];
        iov->iov_len = data_indication_header(route, shdr[i], size);
        iov++;
    }
    iov->iov_base = (void *)payload;
    iov->iov_len = size;
    iov++;
    if (route->rewrite == REWRITE_DATA_INDICATION && (size & 3)) {
        iov->iov_base = (void *)zeros;
        iov->iov_len = 4 - (size & 3);
        iov++;
    }
    smsg[i].msg_hdr.msg_iovlen = (size_t)(iov - siov[i]);
    spayload[i] = size;
    if (dest != NULL) {
        memcpy(&sdest[i], dest, dest_len);
        smsg[i].msg_hdr.msg_name = &sdest[i];
        smsg[i].msg_hdr.msg_namelen = dest_len;
    } else {
        smsg[i].msg_hdr.msg_name = &route->dest_sa;
        smsg[i].msg_hdr.msg_namelen = route->dest_salen;
    }
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
    sfd[i] = route->out_fd;
    sroute[i] = Py_NewRef((PyObject *)route);
    stap[i] = Py_NewRef((PyObject *)self);
    queued = i + 1;
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

/* A Send indication this plane forwards: its peer and DATA. Returns 1, or 0
 * for anything fastpath.parse_send_indication would not accept either. */
static int
parse_send(const unsigned char *buf, size_t size, struct sockaddr_storage *peer,
           socklen_t *peer_len, const unsigned char **data, size_t *data_len)
{
    static const unsigned char cookie[4] = {0x21, 0x12, 0xA4, 0x42};
    if (size < STUN_HEADER || buf[0] != 0 || buf[1] != SEND_INDICATION)
        return 0;
    size_t length = ((size_t)buf[2] << 8) | buf[3];
    if (length + STUN_HEADER != size || (length & 3) || memcmp(buf + 4, cookie, 4))
        return 0;
    int have_peer = 0, have_data = 0;
    size_t offset = STUN_HEADER;
    while (offset < size) {
        if (size - offset < 4)
            return 0;
        unsigned kind = ((unsigned)buf[offset] << 8) | buf[offset + 1];
        size_t alen = ((size_t)buf[offset + 2] << 8) | buf[offset + 3];
        size_t start = offset + 4, end = start + alen;
        if (end > size)
            return 0;
        const unsigned char *v = buf + start;
        switch (kind) {
        case ATTR_DATA:
            if (have_data)
                return 0;
            have_data = 1;
            *data = v;
            *data_len = alen;
            break;
        case ATTR_XOR_PEER_ADDRESS: {
            if (have_peer || alen < 2)
                return 0;
            have_peer = 1;
            memset(peer, 0, sizeof(*peer));
            unsigned short port = (unsigned short)((((unsigned)v[2] << 8) | v[3]) ^ 0x2112);
            if (v[1] == 0x01 && alen == 8) {
                struct sockaddr_in *v4 = (struct sockaddr_in *)peer;
                v4->sin_family = AF_INET;
                v4->sin_port = htons(port);
                unsigned char *a = (unsigned char *)&v4->sin_addr;
                for (int k = 0; k < 4; k++)
                    a[k] = v[4 + k] ^ cookie[k];
                *peer_len = sizeof(*v4);
            } else if (v[1] == 0x02 && alen == 20) {
                struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)peer;
                v6->sin6_family = AF_INET6;
                v6->sin6_port = htons(port);
                unsigned char *a = (unsigned char *)&v6->sin6_addr;
                for (int k = 0; k < 16; k++)
                    a[k] = v[4 + k] ^ buf[4 + k]; /* cookie + transaction id */
                *peer_len = sizeof(*v6);
            } else {
                return 0;
            }
            break;
        }
        case ATTR_DONT_FRAGMENT:
            if (alen != 0)
                return 0;
            break;
        case ATTR_FINGERPRINT: {
            if (alen != 4 || end != size)
                return 0;
            uint32_t expected = crc32_of(buf, offset) ^ FINGERPRINT_XOR;
            uint32_t got = ((uint32_t)v[0] << 24) | ((uint32_t)v[1] << 16) |
                           ((uint32_t)v[2] << 8) | v[3];
            if (got != expected)
                return 0;
            break;
        }
        default:
            return 0;
        }
        offset = start + ((alen + 3) & ~(size_t)3);
    }
    return have_peer && have_data && offset == size;
}

/* Forward one routed datagram: apply the route's rewrite and budget, then
 * queue it. Returns 0 when done with it (forwarded, or dropped and
 * counted), 1 when it is the fallback's after all (an unusual Send
 * indication), -1 with an exception set. */
static int
route_forward(RouteTap *self, Route *r, const unsigned char *buf, size_t size)
{
    const unsigned char *payload = buf;
    size_t length = size;
    struct sockaddr_storage peer;
    socklen_t peer_len = 0;
    if (r->rewrite == REWRITE_UNWRAP_CHANNEL) {
        if (size < CHANNEL_HEADER) {
            self->c.malformed += 1;
            return 0;
        }
        length = ((size_t)buf[2] << 8) | buf[3];
        if (size < CHANNEL_HEADER + length ||
            size - CHANNEL_HEADER - length > CHANNEL_MAX_PADDING) {
            self->c.malformed += 1;
            return 0;
        }
        payload = buf + CHANNEL_HEADER;
    } else if (r->rewrite == REWRITE_UNWRAP_SEND) {
        if (!parse_send(buf, size, &peer, &peer_len, &payload, &length) ||
            peer.ss_family != r->out_family)
            return 1;
        PyObject *where = tuple_from_sockaddr(&peer);
        if (where == NULL)
            return -1;
        PyObject *host = PyTuple_GET_ITEM(where, 0);
        int permitted = PyDict_Contains(r->permissions, host);
        int refused = permitted == 1 && r->refuse != NULL ? PySet_Contains(r->refuse, host) : 0;
        if (refused == 1 && r->approved != NULL) {
            /* One of the service's own hosts: the fallback judged this port
             * and approved it until a deadline (it re-judges after). */
            PyObject *until = PyDict_GetItemWithError(r->approved, where);
            if (until != NULL && PyFloat_Check(until)) {
                struct timespec ts;
                clock_gettime(CLOCK_MONOTONIC, &ts);
                double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
                if (now < PyFloat_AS_DOUBLE(until))
                    refused = 0;
            } else if (until == NULL && PyErr_Occurred()) {
                refused = -1;
            }
        }
        Py_DECREF(where);
        if (permitted < 0 || refused < 0)
            return -1;
        if (!permitted || refused)
            return 1;
    } else if (r->rewrite == REWRITE_DATA_INDICATION &&
               size > 0xFFFF - (MAX_HEADER - STUN_HEADER) - 3) {
        /* Its length field could not hold it. */
        self->c.malformed += 1;
        return 0;
    }
    if (r->budget != NULL && !budget_ok((Budget *)r->budget, length)) {
        self->c.throttled += 1; /* and on the budget */
        return 0;
    }
    r->packets += 1;
    r->octets += length;
    if (peer_len)
        route_queue(self, r, payload, length, &peer, peer_len);
    else
        route_queue(self, r, payload, length, NULL, 0);
    return 0;
}

/* Keys with a prefix ((host, port), first bytes) come from few flows too;
 * building one (a bytes object, a tuple, their hashes) costs more than the
 * lookup. A direct-mapped cache keyed by the address tuple (itself cached,
 * so the same object for the same source) and the prefix bytes. */
#define KEY_CACHE 1024

typedef struct {
    PyObject *addr;
    PyObject *key;
    int size;
    unsigned char prefix[MAX_PREFIX];
} KeyEntry;

static KeyEntry kcache[KEY_CACHE];

/* A new reference to ((host, port), buf[:size]), or NULL with an exception. */
static PyObject *
prefix_key(PyObject *addr, const unsigned char *buf, int size)
{
    uintptr_t h = (uintptr_t)addr >> 4;
    for (int k = 0; k < size; k++)
        h = (h ^ buf[k]) * 16777619u;
    KeyEntry *e = &kcache[(h >> 7) & (KEY_CACHE - 1)];
    if (e->addr == addr && e->size == size && memcmp(e->prefix, buf, (size_t)size) == 0)
        return Py_NewRef(e->key);
    PyObject *key = Py_BuildValue("(Oy#)", addr, (const char *)buf, (Py_ssize_t)size);
    if (key == NULL)
        return NULL;
    Py_XSETREF(e->addr, Py_NewRef(addr));
    Py_XSETREF(e->key, Py_NewRef(key));
    e->size = size;
    memcpy(e->prefix, buf, (size_t)size);
    return key;
}

/* One datagram (number `i` of the batch, or -1: handed in as `data`).
 * `key` is its source (host, port); the fallback gets `addr` (the form the
 * reader had, e.g. a 4-tuple on IPv6). Returns 0, or -1 with an exception
 * set. */
static int
route_one(RouteTap *self, int i, const unsigned char *buf, size_t size, PyObject *key,
          PyObject *addr, PyObject *data)
{
    if (size > (size_t)self->max_size) {
        self->c.malformed += 1;
        return 0;
    }
    PyObject *route = NULL;
    if (self->prefix == 0) {
        route = PyDict_GetItemWithError(self->routes, key);
    } else if (size >= (size_t)self->prefix) {
        PyObject *full = prefix_key(key, buf, self->prefix);
        if (full == NULL)
            return -1;
        route = PyDict_GetItemWithError(self->routes, full);
        Py_DECREF(full);
    }
    if (route == NULL && PyErr_Occurred())
        return -1;
    if (route != NULL && PyObject_TypeCheck(route, &RouteType) &&
        length_ok(self, buf, size)) {
        int rc = route_forward(self, (Route *)route, buf, size);
        if (rc <= 0)
            return rc;
    }
    /* Not ours to forward: keep order, flush first, then Python decides. */
    flush_sends();
    if (!self->ancillary)
        return call_fallback(self->fallback, buf, size, data, addr, NULL);
    PyObject *ancdata = i >= 0 ? ancdata_list(i) : PyList_New(0);
    if (ancdata == NULL)
        return -1;
    int rc = call_fallback(self->fallback, buf, size, data, addr, ancdata);
    Py_DECREF(ancdata);
    return rc;
}

/* Read the socket into the arena, up to MAX_ROUNDS batches, routing each
 * datagram; what is routed stays queued for the caller's flush. Returns 0,
 * or -1 with an exception set (the queue flushed). */
static int
route_drain(RouteTap *self)
{
    if (self->fd < 0 || draining)
        return 0;
    draining = 1;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        int base = arena_take();
        prepare_recv(base);
        if (self->ancillary) {
            for (int i = base; i < base + RECV_BATCH; i++) {
                rmsg[i].msg_hdr.msg_control = rctl[i];
                rmsg[i].msg_hdr.msg_controllen = TAP_CONTROL;
            }
        }
        int n;
        do {
            n = recvmmsg(self->fd, &rmsg[base], RECV_BATCH, MSG_DONTWAIT, NULL);
        } while (n < 0 && errno == EINTR);
        if (n <= 0)
            break;
        arena_used = base + n;
        self->c.batches += 1;
        self->c.drained += (unsigned long long)n;
        for (int i = base; i < base + n; i++) {
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
            int rc = route_one(self, i, rbuf[i], rmsg[i].msg_len, addr, addr, NULL);
            Py_DECREF(addr);
            if (rc < 0) {
                flush_sends();
                draining = 0;
                return -1;
            }
            /* The fallback closed this tap (a released pair): the rest of
             * the batch belongs to nobody. */
            if (self->fd < 0)
                break;
        }
        if (n < RECV_BATCH || self->fd < 0)
            break;
    }
    draining = 0;
    return 0;
}

/* An entry point's return: nothing stays queued once Python code runs. */
static PyObject *
flushed(int rc)
{
    flush_sends();
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
RouteTap_readable(RouteTap *self, PyObject *unused)
{
    return flushed(route_drain(self));
}

/* One datagram read by someone else (a TCP framer, a DTLS session, an
 * asyncio endpoint): the same decision as for a drained one. */
static PyObject *
RouteTap_datagram_received(RouteTap *self, PyObject *args)
{
    PyObject *data, *addr;
    if (!PyArg_ParseTuple(args, "SO", &data, &addr))
        return NULL;
    PyObject *key = key_from_addr(addr);
    if (key == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "addr must be (host, port, ...)");
        return NULL;
    }
    int rc = route_one(self, -1, (const unsigned char *)PyBytes_AS_STRING(data),
                       (size_t)PyBytes_GET_SIZE(data), key, addr, data);
    Py_DECREF(key);
    /* The queued send points into `data`: flush before it can go away. */
    return flushed(rc);
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
    int fd = -1;
    if (sock != Py_None) {
        fd = fd_of(sock);
        if (fd < 0)
            return -1;
    }
    self->fd = fd;
    gso_set_fd(fd, 1); /* a new socket on this fd: GSO may work again */
    self->prefix = prefix;
    self->length_at = length_at;
    self->max_size = max_size;
    self->ancillary = (char)ancillary;
    Py_XSETREF(self->sock, Py_NewRef(sock));
    Py_XSETREF(self->routes, Py_NewRef(routes));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    return 0;
}

static void
RouteTap_release(RouteTap *self)
{
    /* A queued datagram holds its tap: nothing of this one is queued. */
}

#define ROUTE_TAP_REFS(X) X(sock) X(routes) X(fallback)
GC_FUNCTIONS(RouteTap, ROUTE_TAP_REFS)

static PyMethodDef RouteTap_methods[] = {
    {"readable", (PyCFunction)RouteTap_readable, METH_NOARGS,
     "Drain the socket (for loop.add_reader)."},
    {"datagram_received", (PyCFunction)RouteTap_datagram_received, METH_VARARGS,
     "datagram_received(data, addr): route one datagram read elsewhere."},
    {"close", (PyCFunction)RouteTap_close, METH_NOARGS,
     "Stop reading (the owner closes the socket)."},
    {NULL},
};

static PyMemberDef RouteTap_members[] = {
    {"fd", T_INT, offsetof(RouteTap, fd), READONLY, "Socket fd (-1: closed, or none)."},
    {"prefix", T_INT, offsetof(RouteTap, prefix), READONLY,
     "Datagram bytes in the route key (0: the source address alone)."},
    {"length_at", T_INT, offsetof(RouteTap, length_at), READONLY,
     "Offset of the u16 length a routed datagram must agree with (-1: none)."},
    {"max_size", T_INT, offsetof(RouteTap, max_size), READONLY,
     "Larger datagrams are dropped and counted as malformed."},
    {"ancillary", T_BOOL, offsetof(RouteTap, ancillary), READONLY,
     "Whether the fallback gets the datagram's control messages (ancdata)."},
    {"sock", T_OBJECT_EX, offsetof(RouteTap, sock), READONLY,
     "The socket read (None: datagrams are handed in)."},
    {"routes", T_OBJECT_EX, offsetof(RouteTap, routes), READONLY,
     "The route table: key -> Route."},
    {"fallback", T_OBJECT_EX, offsetof(RouteTap, fallback), READONLY,
     "callable(data, (host, port)[, ancdata]) for datagrams without a route."},
    COUNTER_MEMBERS(RouteTap),
    {NULL},
};

static PyTypeObject RouteTapType = TYPE_OBJECT(
    RouteTap, "A socket forwarded by a route table (see dataplane.py).",
    PyType_GenericNew);

/* ------------------------------------------------------------ Poller */

/* One epoll set holding every tapped socket (relay sockets, and the
 * listening sockets the taps read themselves). The event loop watches only the epoll fd: one
 * wakeup, one Python-level call, then poll() drains every ready socket in C.
 * With one relay socket per allocation this replaces one event-loop callback
 * per socket per datagram. Level-triggered: a socket left with data (the
 * MAX_ROUNDS cap) keeps the epoll fd readable for the next loop turn. */
#define POLL_EVENTS 128

typedef struct {
    PyObject_HEAD
    int epfd;
    PyObject *taps; /* dict fd -> tap (keeps them alive while registered) */
    unsigned long long wakeups;
    unsigned long long events;
    unsigned long long sends;
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
    if (!PyObject_TypeCheck(tap, &RouteTapType)) {
        PyErr_SetString(PyExc_TypeError, "tap must be a RouteTap");
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
    /* Every ready socket into the arena, then one flush: the datagrams of
     * many relay sockets bound for the one listening socket leave in one
     * sendmmsg (see the top of this file). */
    unsigned long long calls = sendmmsg_calls;
    int failed = 0;
    for (int i = 0; i < n && !failed; i++) {
        RouteTap *routed = (RouteTap *)held[i];
        if (routed->fd >= 0 && route_drain(routed) < 0)
            failed = 1;
    }
    flush_sends();
    self->sends += sendmmsg_calls - calls;
    for (int i = 0; i < n; i++)
        Py_DECREF(held[i]);
    if (failed)
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

static void
Poller_release(Poller *self)
{
    if (self->epfd >= 0) {
        close(self->epfd);
        self->epfd = -1;
    }
}

#define POLLER_REFS(X) X(taps)
GC_FUNCTIONS(Poller, POLLER_REFS)

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
     "register(fd, tap): drain `fd` with `tap` (a RouteTap)."},
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
    {"sends", T_ULONGLONG, offsetof(Poller, sends), READONLY,
     "sendmmsg calls its poll() calls made (one per outgoing socket per wakeup)."},
    {NULL},
};

static PyTypeObject PollerType = TYPE_OBJECT(
    Poller, "An epoll set of route taps, drained in C.", Poller_new);

/* ------------------------------------------------------------ module */

static PyObject *
module_set_gso(PyObject *m, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    gso_enabled = on;
    Py_RETURN_NONE;
}

static PyObject *
module_gso_stats(PyObject *m, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:K,s:K,s:K}", "enabled", gso_enabled ? Py_True : Py_False,
                         "sends", gso_sends, "segments", gso_segments, "refused", gso_refused);
}

static PyMethodDef module_methods[] = {
    {"set_gso", (PyCFunction)module_set_gso, METH_O,
     "set_gso(enabled): send bursts to one destination as UDP GSO messages."},
    {"gso_stats", (PyCFunction)module_gso_stats, METH_NOARGS,
     "{'enabled', 'sends' (GSO messages), 'segments' (datagrams in them), "
     "'refused' (sockets that fell back)}."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_methods = module_methods,
    .m_name = "crossroads.transport._turnfast",
    .m_doc = "The relay data plane (recvmmsg/sendmmsg); see dataplane.py.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__turnfast(void)
{
    crc_init();
    PyTypeObject *types[] = {&BudgetType, &RouteType, &RouteTapType, &PollerType};
    const char *names[] = {"Budget", "Route", "RouteTap", "Poller"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) < 0 ||
        PyModule_AddIntConstant(m, "REWRITE_NONE", REWRITE_NONE) < 0 ||
        PyModule_AddIntConstant(m, "REWRITE_UNWRAP_CHANNEL", REWRITE_UNWRAP_CHANNEL) < 0 ||
        PyModule_AddIntConstant(m, "REWRITE_WRAP_CHANNEL", REWRITE_WRAP_CHANNEL) < 0 ||
        PyModule_AddIntConstant(m, "REWRITE_DATA_INDICATION", REWRITE_DATA_INDICATION) < 0 ||
        PyModule_AddIntConstant(m, "REWRITE_UNWRAP_SEND", REWRITE_UNWRAP_SEND) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
