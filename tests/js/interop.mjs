// js-libp2p (an implementation nobody here wrote) against p2pswarm's nodes: tests/test_js_interop.py.
//
// Usage: node --experimental-websocket interop.mjs '<json>' with
//   { bootstrap: ADDR, worker: ADDR, unitKey: HEX, relay: ADDR, relayedWorker: CIRCUIT_ADDR,
//     provider: PEER_ID (stop the provider look-up once it is found), kadProtocol: "/p2pswarm/kad/1.0.0", expertProtocol: "/p2pswarm/expert/1.0.0" }
// Prints one JSON line with what it saw; the Python test makes the assertions.
if (typeof Promise.withResolvers !== 'function') {  // Node 20 lacks it; js-libp2p 3.x needs it
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new Promise((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}

const { createLibp2p } = await import('libp2p')
const { tcp } = await import('@libp2p/tcp')
const { webSockets } = await import('@libp2p/websockets')
const { noise } = await import('@chainsafe/libp2p-noise')
const { yamux } = await import('@chainsafe/libp2p-yamux')
const { identify } = await import('@libp2p/identify')
const { ping } = await import('@libp2p/ping')
const { kadDHT, passthroughMapper } = await import('@libp2p/kad-dht')
const { circuitRelayTransport } = await import('@libp2p/circuit-relay-v2')
const { multiaddr } = await import('@multiformats/multiaddr')
const { CID } = await import('multiformats/cid')
const Digest = await import('multiformats/hashes/digest')

const cfg = JSON.parse(process.argv[2])
const out = { errors: [] }
const step = async (name, fn) => {
  try {
    out[name] = await fn()
  } catch (err) {
    out.errors.push(`${name}: ${err?.name ?? 'Error'}: ${err?.message ?? err}`)
  }
}
const timeout = (ms) => AbortSignal.timeout(ms)
const pid = (addr) => addr.split('/p2p/').pop()
const direct = [cfg.bootstrap, cfg.worker, cfg.relay].map(a => a.split('/p2p/')[0])

const node = await createLibp2p({
  addresses: { listen: [`${cfg.relay}/p2p-circuit`] }, // a reservation on our relay
  transports: [tcp(), webSockets(), circuitRelayTransport()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  // Everything here is on loopback, so allow private addresses; but dial only the relay and the
  // direct worker directly: the relayed worker is reachable through its circuit only, as behind a NAT.
  connectionGater: {
    denyDialMultiaddr: (ma) => {
      const s = ma.toString()
      return !s.includes('/p2p-circuit') && !direct.some(d => s.startsWith(d))
    }
  },
  services: {
    identify: identify(),
    ping: ping({ maxOutboundStreams: 4 }), // the DHT's routing table pings new contacts too
    // passthroughMapper: keep loopback addresses (the default mapper drops private ones, for the public DHT)
    dht: kadDHT({ protocol: cfg.kadProtocol, clientMode: true, peerInfoMapper: passthroughMapper })
  }
})

async function protocolsOf (peerAddr, expected) {
  // identify runs on every new connection; wait until its result is in the peer store
  const conn = await node.dial(multiaddr(peerAddr), { signal: timeout(20000) })
  const deadline = Date.now() + 20000
  let protocols = []
  while (Date.now() < deadline) {
    const peer = await node.peerStore.get(conn.remotePeer).catch(() => null)
    protocols = peer?.protocols ?? []
    if (protocols.includes(expected)) break
    await new Promise(resolve => setTimeout(resolve, 100))
  }
  return protocols
}

await step('workerProtocols', () => protocolsOf(cfg.worker, cfg.expertProtocol))
await step('pingMs', () => node.services.ping.ping(multiaddr(cfg.worker), { signal: timeout(10000) }))
await step('bootstrapProtocols', () => protocolsOf(cfg.bootstrap, cfg.kadProtocol))
await step('providers', async () => {
  const digest = Digest.decode(Uint8Array.from(Buffer.from(cfg.unitKey, 'hex')))
  const cid = CID.createV1(0x55, digest)
  const found = new Set()
  const controller = new AbortController()
  const timer = setTimeout(() => controller.abort(), 20000)
  try {
    for await (const p of node.contentRouting.findProviders(cid, { signal: controller.signal })) {
      found.add(p.id.toString())
      if (cfg.provider != null && found.has(cfg.provider)) break // the query may go on to its end
    }
  } catch (err) {
    if (found.size === 0) throw err
  } finally {
    clearTimeout(timer)
  }
  return [...found]
})
await step('reservation', async () => {
  const deadline = Date.now() + 20000
  while (Date.now() < deadline) {
    const addrs = node.getMultiaddrs().map(String).filter(a => a.includes('/p2p-circuit'))
    if (addrs.length > 0) return addrs
    await new Promise(resolve => setTimeout(resolve, 100))
  }
  throw new Error('no reservation on the relay within 20 s')
})
await step('relayedWorkerProtocols', () => protocolsOf(cfg.relayedWorker, cfg.expertProtocol))
await step('relayedIdentify', async () => { // an explicit identify over the circuit: what it reports
  const conn = await node.dial(multiaddr(cfg.relayedWorker), { signal: timeout(20000) }) // the open one
  const result = await node.services.identify.identify(conn, { signal: timeout(10000) })
  const observed = result.observedAddr?.toString() ?? null
  return { remoteAddr: conn.remoteAddr.toString(), protocols: result.protocols, observedAddr: observed === '/' ? null : observed }
})
out.peerId = node.peerId.toString()
console.log(JSON.stringify(out))
await node.stop()
process.exit(0)
