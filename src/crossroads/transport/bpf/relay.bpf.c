// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * crossroads kernel data plane: relayed UDP forwarded on tc ingress.
 *
 * Theory of operation
 * -------------------
 * The route table in user space (crossroads.transport.kernelplane) writes one
 * entry of the `routes` hash map per proven flow. A UDP datagram arriving on
 * a device this program is attached to is looked up by
 *   (family, destination address and port, source address and port, channel)
 * where `channel` is the ChannelData channel number when the payload starts
 * like ChannelData (RFC 8656 §12.4: first two bits 01) and a route for it
 * exists, else 0. With a route, the datagram is rewritten and sent out of the
 * route's device with bpf_redirect_neigh (the kernel resolves the next hop's
 * link-layer address, as for a packet the host sends); without one it goes
 * on down the chain (PASS below: other processes' programs, then the
 * stack), unmodified, and so to the sockets (STUN/TURN control, Send/Data
 * indications, first packets, unknown routes: everything the control plane
 * must see).
 *
 * Actions (route_val.kind):
 *   UNWRAP_CHANNEL  TURN client -> peer: the 4-byte ChannelData header comes
 *                   off (its length field must equal the data's length: a
 *                   padded or short datagram goes to the stack, which has the
 *                   full check of RFC 8656 §12.5);
 *   WRAP_CHANNEL    TURN peer -> client: a 4-byte ChannelData header for the
 *                   bound channel goes on (no padding over UDP, §12.5);
 *   REWRITE         natneg relay pairs, RakNet UDPProxy: the datagram as is;
 *   RELAY           Unity RELAY frames, as is. A host's frames to each of
 *                   its joiners share one source and destination, so these
 *                   routes live in `relay_routes`, keyed also by the frame's
 *                   first 36 bytes (signature, version, type RELAY, from and
 *                   to allocation IDs), and are taken only when the frame's
 *                   DataLength (u16 at offset 36) is the rest of it: anything
 *                   else from that client (BIND, PING, DISCONNECT, CLOSE, a
 *                   frame to an unconnected ID) reaches the relay's socket.
 * Each rewrites the source to the relay's address and port on the far side
 * and the destination to the route's destination, sets the hop limit of a
 * new datagram (64, what the sockets send with) and fixes the IP and UDP
 * checksums incrementally (so a checksum the device will complete, on a
 * CHECKSUM_PARTIAL packet from a local or veth sender, stays correct too).
 * Each route counts packets and payload bytes (what the sockets' plane counts
 * as a route's packets and octets) for idle timeouts, quotas and metrics.
 *
 * Safety: nothing is forwarded without a live entry; removing the entry
 * stops the forwarding of the next packet. Only plain IPv4 (no options,
 * not fragmented) and IPv6 (UDP as the first next header) of one family on
 * both sides, non-GSO packets, are handled; anything else passes.
 * No loops: the program is straight-line apart from fixed-size copies.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <stddef.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#define KIND_UNWRAP_CHANNEL 1
#define KIND_WRAP_CHANNEL 2
#define KIND_REWRITE 3
#define KIND_RELAY 4

/* Unity RELAY: the bytes that name a route (header + from + to IDs), then
 * the u16 DataLength (crossroads.proto.relay.messages). */
#define RELAY_HEAD 36
#define RELAY_HEADER 38

/* Hop limit of a datagram the relay sends (Linux's default ip_default_ttl
 * and IPv6 hop_limit, what the socket planes send with). */
#define NEW_HOP_LIMIT 64
#define CHANNEL_HEADER 4

struct route_key {
	__u32 saddr[4]; /* IPv4: [0] only; saddr, daddr adjacent as in IPv6 */
	__u32 daddr[4];
	__u16 sport; /* network order */
	__u16 dport;
	__u16 channel; /* host order; 0 for routes keyed by address alone */
	__u8 family;   /* 4 or 6 */
	__u8 pad;
};

struct route_val {
	__u32 saddr[4]; /* the datagram's new source (the relay's far side) */
	__u32 daddr[4]; /* and destination */
	__u16 sport;    /* network order */
	__u16 dport;
	__u16 channel; /* WRAP_CHANNEL: the channel number, host order */
	__u8 kind;
	__u8 pad;
	__u32 ifindex; /* the device it leaves by */
	__u32 pad2;
	__u64 packets; /* counted here, read by user space */
	__u64 bytes;   /* payload bytes (without the ChannelData header) */
};

/* Bounded by the control plane's own caps (allocations x channels,
 * forwarders, relay pairs); user space refuses to install past it and the
 * route stays on the socket plane. Not preallocated: every process of a
 * host (--workers N, a test suite) loads its own maps, and a preallocated
 * pair costs ~25 MB of kernel memory and doubles the load time whether or
 * not it ever holds a route; only user space inserts (never the program),
 * so an insert that cannot allocate just leaves the route on the sockets. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct route_key);
	__type(value, struct route_val);
} routes SEC(".maps");

struct relay_key {
	struct route_key flow; /* channel 0 */
	__u8 head[RELAY_HEAD];
};

/* Unity RELAY routes (KIND_RELAY), bounded by the relay's allocations x
 * connections; the same value as `routes`, not preallocated either. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct relay_key);
	__type(value, struct route_val);
} relay_routes SEC(".maps");

/* Largest payload moved for a ChannelData header (a mask: 2047 bytes, more
 * than an Ethernet MTU's datagram); a larger one goes to the stack. */
#define MAX_MOVE 2047

/* Per-CPU room to move a datagram's data by the header's 4 bytes. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u8[MAX_MOVE + 1]);
} scratch SEC(".maps");

/* The lease of a program on a classic tc filter (Linux < 6.6): [0] is the
 * CLOCK_MONOTONIC deadline in ns its process keeps pushing forward, 0 when
 * every attachment is a tcx link (which dies with its process's descriptor).
 * A classic filter outlives a SIGKILLed process, and so do this program and
 * its maps (the filter holds them): past the deadline it passes everything,
 * so a dead process's stale routes forward nothing. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} lease SEC(".maps");

/* What the program does not route goes on down the chain: the next tcx
 * program or classic filter on the device (each crossroads process on the
 * host has its own, with its own routes), then the stack. TCX_NEXT and
 * TC_ACT_UNSPEC are both -1 (include/uapi/linux/bpf.h, pkt_cls.h); a
 * program that returned TC_ACT_OK (TCX_PASS) would end the chain and hide
 * the packet from every later process's program. */
#define PASS TC_ACT_UNSPEC

static __always_inline int
csum_l4(struct __sk_buff *skb, __u32 off, __u32 from, __u32 to, __u64 flags)
{
	return bpf_l4_csum_replace(skb, off, from, to, flags | BPF_F_MARK_MANGLED_0);
}

SEC("tc")
int crossroads_relay(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct route_key key = {};
	__u32 l4;
	__u16 ulen;

	__u32 zero = 0;
	__u64 *deadline = bpf_map_lookup_elem(&lease, &zero);
	if (!deadline || (*deadline && bpf_ktime_get_ns() > *deadline))
		return PASS; /* its process is gone (or stalled): the sockets decide */
	if (skb->gso_size)
		return PASS; /* an aggregate: the stack splits it */
	if ((void *)(eth + 1) > end)
		return PASS;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
		    (ip->frag_off & bpf_htons(0x3FFF)))
			return PASS;
		key.family = 4;
		key.saddr[0] = ip->saddr;
		key.daddr[0] = ip->daddr;
		l4 = sizeof(*eth) + sizeof(*ip);
		ulen = bpf_ntohs(ip->tot_len) - sizeof(*ip);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_UDP)
			return PASS;
		key.family = 6;
		__builtin_memcpy(key.saddr, &ip6->saddr, 16);
		__builtin_memcpy(key.daddr, &ip6->daddr, 16);
		l4 = sizeof(*eth) + sizeof(*ip6);
		ulen = bpf_ntohs(ip6->payload_len);
	} else {
		return PASS;
	}
	struct udphdr *udp = data + l4;
	if ((void *)(udp + 1) > end || bpf_ntohs(udp->len) != ulen || ulen < sizeof(*udp))
		return PASS;
	key.sport = udp->source;
	key.dport = udp->dest;

	struct route_val *r = NULL;
	__u8 *p = (void *)(udp + 1);
	__u32 chanword = 0;
	if ((void *)(p + CHANNEL_HEADER) <= end && (p[0] & 0xC0) == 0x40) {
		key.channel = ((__u16)p[0] << 8) | p[1];
		r = bpf_map_lookup_elem(&routes, &key);
		if (r && r->kind != KIND_UNWRAP_CHANNEL)
			r = NULL;
		if (r) {
			__u16 length = ((__u16)p[2] << 8) | p[3];
			if (length != ulen - sizeof(*udp) - CHANNEL_HEADER)
				return PASS;
			chanword = *(__u32 *)p;
		}
	}
	if (!r && (void *)(p + RELAY_HEADER) <= end) {
		/* A Unity RELAY frame? Its route names its first 36 bytes; its
		 * DataLength must be the rest (else the relay's socket decides). */
		struct relay_key rkey = {};
		__u16 length = ((__u16)p[RELAY_HEAD] << 8) | p[RELAY_HEAD + 1];
		if (length == ulen - sizeof(*udp) - RELAY_HEADER) {
			rkey.flow = key;
			rkey.flow.channel = 0;
			__builtin_memcpy(rkey.head, p, RELAY_HEAD);
			r = bpf_map_lookup_elem(&relay_routes, &rkey);
			if (r && r->kind != KIND_RELAY)
				r = NULL;
		}
	}
	if (!r) {
		key.channel = 0;
		r = bpf_map_lookup_elem(&routes, &key);
		if (!r || r->kind == KIND_UNWRAP_CHANNEL || r->kind == KIND_RELAY)
			return PASS;
	}

	__u32 payload = ulen - sizeof(*udp);
	__u16 new_ulen = ulen;
	int delta = 0;
	if (r->kind == KIND_UNWRAP_CHANNEL) {
		delta = -CHANNEL_HEADER;
		payload -= CHANNEL_HEADER;
	} else if (r->kind == KIND_WRAP_CHANNEL) {
		if (ulen > 0xFFFF - CHANNEL_HEADER - 40)
			return PASS;
		delta = CHANNEL_HEADER;
		chanword = bpf_htonl(((__u32)r->channel << 16) | payload);
	}
	new_ulen = ulen + delta;
	__u16 new_sport = r->sport, new_dport = r->dport;

	/* The data moves by `delta` behind a UDP header that stays where it is
	 * (bpf_skb_adjust_room would move the headers instead, and a
	 * CHECKSUM_PARTIAL packet's csum_start with them, which no helper
	 * fixes): copy it out, resize the tail, copy it back. */
	if (delta) {
		__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
		__u32 from = l4 + sizeof(*udp) + (delta < 0 ? CHANNEL_HEADER : 0);
		__u32 size = payload;
		if (!buf || size > MAX_MOVE)
			return PASS;
		if (size && bpf_skb_load_bytes(skb, from, buf, size & MAX_MOVE))
			return PASS;
		if (bpf_skb_change_tail(skb, l4 + new_ulen, 0))
			return PASS; /* nothing changed yet */
		__u32 to = l4 + sizeof(*udp) + (delta > 0 ? CHANNEL_HEADER : 0);
		if (size && bpf_skb_store_bytes(skb, to, buf, size & MAX_MOVE, 0))
			return TC_ACT_SHOT;
	}

	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	udp = data + l4;
	if ((void *)(udp + 1) > end)
		return TC_ACT_SHOT;
	/* Every change as a checksum delta: the removed or added ChannelData
	 * word (a 4-byte shift keeps the 16-bit alignment of what follows), the
	 * ports, the length (in the header and in the pseudo-header) and the
	 * addresses (pseudo-header). */
	__u32 csum_off = l4 + offsetof(struct udphdr, check);
	if (r->kind == KIND_UNWRAP_CHANNEL) {
		csum_l4(skb, csum_off, chanword, 0, 4);
	} else if (r->kind == KIND_WRAP_CHANNEL) {
		if (bpf_skb_store_bytes(skb, l4 + sizeof(*udp), &chanword, 4, 0))
			return TC_ACT_SHOT;
		csum_l4(skb, csum_off, 0, chanword, 4);
	}
	csum_l4(skb, csum_off, key.sport, new_sport, 2);
	csum_l4(skb, csum_off, key.dport, new_dport, 2);
	csum_l4(skb, csum_off, bpf_htons(ulen), bpf_htons(new_ulen), 2);
	csum_l4(skb, csum_off, bpf_htons(ulen), bpf_htons(new_ulen), 2 | BPF_F_PSEUDO_HDR);
	__u16 ports_len[2] = {new_sport, new_dport};
	bpf_skb_store_bytes(skb, l4 + offsetof(struct udphdr, source), ports_len, 4, 0);
	__u16 nl = bpf_htons(new_ulen);
	bpf_skb_store_bytes(skb, l4 + offsetof(struct udphdr, len), &nl, 2, 0);

	if (key.family == 4) {
		__u32 l3 = sizeof(struct ethhdr);
		__u32 ip_csum = l3 + offsetof(struct iphdr, check);
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		struct iphdr *ip = data + l3;
		if ((void *)(ip + 1) > end)
			return TC_ACT_SHOT;
		__u16 old_ttl_word = *(__u16 *)&ip->ttl;
		__u16 old_tot = ip->tot_len;
		__u16 new_tot = bpf_htons(new_ulen + sizeof(*ip));
		__u8 ttl_proto[2] = {NEW_HOP_LIMIT, IPPROTO_UDP};
		__u16 new_ttl_word = *(__u16 *)ttl_proto;
		csum_l4(skb, csum_off, key.saddr[0], r->saddr[0], 4 | BPF_F_PSEUDO_HDR);
		csum_l4(skb, csum_off, key.daddr[0], r->daddr[0], 4 | BPF_F_PSEUDO_HDR);
		bpf_l3_csum_replace(skb, ip_csum, key.saddr[0], r->saddr[0], 4);
		bpf_l3_csum_replace(skb, ip_csum, key.daddr[0], r->daddr[0], 4);
		bpf_l3_csum_replace(skb, ip_csum, old_tot, new_tot, 2);
		bpf_l3_csum_replace(skb, ip_csum, old_ttl_word, new_ttl_word, 2);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct iphdr, saddr), r->saddr, 4, 0);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct iphdr, daddr), r->daddr, 4, 0);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct iphdr, tot_len), &new_tot, 2, 0);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct iphdr, ttl), ttl_proto, 1, 0);
	} else {
		__u32 l3 = sizeof(struct ethhdr);
		__s64 diff = bpf_csum_diff(key.saddr, 32, r->saddr, 32, 0);
		/* saddr and daddr are adjacent in the key, the value and the header. */
		if (diff < 0)
			return TC_ACT_SHOT;
		csum_l4(skb, csum_off, 0, (__u32)diff, BPF_F_PSEUDO_HDR);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct ipv6hdr, saddr), r->saddr, 32, 0);
		__u16 plen = bpf_htons(new_ulen);
		bpf_skb_store_bytes(skb, l3 + offsetof(struct ipv6hdr, payload_len), &plen, 2, 0);
		__u8 hop = NEW_HOP_LIMIT;
		bpf_skb_store_bytes(skb, l3 + offsetof(struct ipv6hdr, hop_limit), &hop, 1, 0);
	}
	__sync_fetch_and_add(&r->packets, 1);
	__sync_fetch_and_add(&r->bytes, payload);
	return bpf_redirect_neigh(r->ifindex, NULL, 0, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
