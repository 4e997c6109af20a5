/**
 * Golden tests for the quantizers and fp16 conversion.
 *
 * How the expected bytes were produced (independently of this code, once, on x86-64):
 * - ggml: `quantize_row_q4_0_ref`, `quantize_row_q8_0_ref` and `ggml_compute_fp32_to_fp16` as in
 *   llama.cpp `ggml/src/ggml-quants.c` / `ggml/src/ggml-impl.h`, compiled in a throwaway C file
 *   with `gcc -O2 -std=gnu11` (and checked identical at `-O0`), fed the float32 bit patterns below.
 * - dllama: distributed-llama `converter/writer.py` `writeQuantizedQ40Tensor` and
 *   `writeQuantizedQ80Tensor` run under numpy 1.23.5 (the version its requirements.txt pins) on the
 *   same float32 inputs (only the torch→numpy first line removed).
 * - fp16: a 2^32-input sweep of ggml_compute_fp32_to_fp16 hashed with FNV-1a (NaN inputs skipped)
 *   gave 05404325, and our f16FromF32Bits gives the same hash (run offline: ~1 min); the table of
 *   fp16→fp32 values hashes to 2be6b7cd in both (checked below).
 * Inputs named xorshift-* are regenerated here exactly as the generator script made them
 * (xorshift32, value = float32(int32 / 2^31 · scale)).
 */
import { isConvertError } from './errors';
import {
  BF16_TABLE,
  F16_TABLE,
  Q40_BLOCK_BYTES,
  Q80_BLOCK_BYTES,
  encodeChunk,
  encodedSize,
  f16BitsToF32,
  f32Bits,
  f32ToF16,
  f32ToF16Bits,
  f16FromF32Bits,
  quantizeQ40,
  quantizeQ40Half,
  quantizeQ80,
  quantizeQ80Half,
  decodeToF32,
  assertFinite,
} from './quant';
import type { QuantFlavor } from './types';

interface Golden {
  name: string;
  f32?: string;
  f16?: string;
  bf16?: string;
  gen?: [seed: number, scale: number, block: number];
  /** [Q4_0, Q8_0] block hex */
  ggml: [string, string];
  /** [q40, q80] block hex */
  dllama: [string, string];
}

const GOLDEN: Golden[] = [
  {
    name: 'q8-ties',
    f32: '42fe00003f0000003fc0000040200000bf000000bfc00000c020000042fd0000c2fd000040600000c06000004090000040b0000040d00000c0f0000000000000410800004118000041280000413800004148000041580000416800004178000041840000418c000041940000419c000041a4000041ac000041b4000041bc0000',
    ggml: ['f0cb70787878787878707f78787878787878', '003c7f010203fffefd7f8104fc050607f800090a0b0c0d0e0f101112131415161718'],
    dllama: ['f0cb70787878787878707f78787878787878', '003c7f00020200fefe7e8204fc040606f800080a0a0c0c0e0e101012121414161618'],
  },
  {
    name: 'q4-ties',
    f32: 'c10000003f000000bf0000003fc00000bfc0000040200000c020000040f00000c0f0000040d0000040600000c060000040900000c090000040b00000c0b00000c0800000c0700000c0600000c0500000c0400000c0300000c0200000c0100000c0000000bfe00000bfc00000bfa00000bf800000bf400000bf000000be800000',
    ggml: ['003c4049585a575b666f616f7c757d748e83', '082c8108f818e828d877896738c847b957a9c0c4c8ccd0d4d8dce0e4e8ecf0f4f8fc'],
    dllama: ['003c4049585a575b666f616f7c757d748e83', '082c8108f818e828d877896738c847b957a9c0c4c8ccd0d4d8dce0e4e8ecf0f4f8fc'],
  },
  {
    name: 'q4-ties-posmax',
    f32: '410000003f000000bf0000003fc00000bfc0000040200000c020000040f00000c0f0000040d0000040600000c060000040900000c090000040b00000c0b00000c0800000c0700000c0600000c0500000c0400000c0300000c0200000c0100000c0000000bfe00000bfc00000bfa00000bf800000bf400000bf000000be800000',
    ggml: ['00bcc0c8c9b7bab6bba1afa2a59c949d938e', '082c7f08f818e828d877896738c847b957a9c0c4c8ccd0d4d8dce0e4e8ecf0f4f8fc'],
    dllama: ['00bcc0c8c9b7bab6bba1afa2a59c949d938e', '082c7f08f818e828d877896738c847b957a9c0c4c8ccd0d4d8dce0e4e8ecf0f4f8fc'],
  },
  {
    name: 'zeros',
    f32: '0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000',
    ggml: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'neg-zeros',
    f32: '8000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000',
    ggml: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['000088888888888888888888888888888888', '00800000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'zeros-last-neg',
    f32: '0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000080000000',
    ggml: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['000088888888888888888888888888888888', '00800000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'zeros-last-pos',
    f32: '8000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000000000000',
    ggml: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['008088888888888888888888888888888888', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'neg-max',
    f32: 'c0400000c02e8ba33f22e8babfc5d1743fe8ba2fbeba2e8cc022e8ba3f51745dbfae8ba340000000be3a2e8cc01745d13f800000bf9745d1400ba2e900000000c00ba2e93f9745d1bf800000401745d13e3a2e8cc00000003fae8ba3bf51745d4022e8ba3eba2e8cbfe8ba2f3fc5d174bf22e8ba402e8ba33f0ba2e9bfd1745d',
    ggml: ['003620b15ae48d37c16af49d38c26bf59e48', '0c26818d1bbf4df19423c655f89c2ace5c00a432d66408ab3add6c0fb341e57317bb'],
    dllama: ['003620b15ae48d37c16af49d38c26bf59e48', '0c26818d1bbf4df19423c655f89c2ace5c00a432d66408ab3add6c0fb341e57317bb'],
  },
  {
    name: 'all-negative',
    f32: 'be124925be924925bedb6db7bf124925bf36db6ebf5b6db7bf800000bf924925bfa49249bfb6db6ebfc92492bfdb6db7bfedb6dbc0000000c0092492c0124925c01b6db7c0249249c02db6dbc036db6ec0400000c0492492c0524925c05b6db7c0649249c06db6dbc076db6ec0800000c0849249c0892492c08db6dbc0924925',
    ggml: ['923848483737373726262626151515150404', '9c28fcf8f4f0ece8e4e0dcd8d4d0ccc8c4c0bdb9b5b1ada9a5a19d9995918d898581'],
    dllama: ['923848483737373726262626151515150404', '9c28fcf8f4f0ece8e4e0dcd8d4d0ccc8c4c0bdb9b5b1ada9a5a19d9995918d898581'],
  },
  {
    name: 'neg-max-last',
    f32: 'bfb33333bdcccccd3f99999abecccccd3f666666bf3333333f19999abf8000003e99999abfa66666000000003fa66666be99999a3f800000bf19999a3f333333bf6666663ecccccdbf99999a3dcccccd3fb33333be4ccccd3f8ccccdbf0000003f4ccccdbf4ccccd3f000000bf8ccccd3e4ccccdbfb33333bdcccccdc0300000',
    ggml: ['803554985b87cb76ba75a964985c974b860a', '8b25bffb37ee2ae01cd20ec4003cf22ee420d612c90541f733e925db17cd09bffb81'],
    dllama: ['803554985b87cb76ba75a964985c974b860a', '8b25bffb37ee2ae01cd20ec4003cf22ee420d612c90541f733e925db17cd09bffb81'],
  },
  {
    name: 'one-huge',
    f32: 'bb449ba6bb03126fba83126f000000003a83126f3b03126f3b449ba6bb449ba6bb03126fba83126f000000003a83126f3b03126f3b449ba6bb449ba6bb03126fba83126f000000003a83126f3b03126f46ea6000bb83126fbb03126f000000003b03126f3b83126fbb83126fbb03126f000000003b03126f3b83126fbb83126f',
    ggml: ['53eb88888888088888888888888888888888', '625b00000000000000000000000000000000000000007f0000000000000000000000'],
    dllama: ['53eb88888888088888888888888888888888', '625b00000000000000000000000000000000000000007f0000000000000000000000'],
  },
  {
    name: 'one-huge-neg',
    f32: 'bd23d70abcf5c28fbca3d70abc23d70a00000000c77fe000bc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a000000003c23d70abc23d70a00000000',
    ggml: ['ff6f88888888888088888888888888888888', '08600000000000810000000000000000000000000000000000000000000000000000'],
    dllama: ['ff6f88888888888088888888888888888888', '08600000000000810000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'abs-tie-neg-first',
    f32: 'c00000003f80000040000000bfb33333bfa66666bf99999abf8ccccdbf800000bf666666bf4ccccdbf333333bf19999abf000000becccccdbe99999abe4ccccdbdcccccd000000003dcccccd3e4ccccd3e99999a3ecccccd3f0000003f19999a3f3333333f4ccccd3f6666663f8000003f8ccccd3f99999a3fa666663fb33333',
    ggml: ['0034808c8f9293a3a4a4b4b5c5c6c6d6d7e7', '082481407fa7adb4bac0c7cdd4dae0e7edf3fa00060d131920262c333940464c5359'],
    dllama: ['00b48f84807e7d6d6c6c5c5b4b4a4a3a3929', '082481407fa7adb4bac0c7cdd4dae0e7edf3fa00060d131920262c333940464c5359'],
  },
  {
    name: 'abs-tie-pos-first',
    f32: '400000003f800000c0000000bfb33333bfa66666bf99999abf8ccccdbf800000bf666666bf4ccccdbf333333bf19999abf000000becccccdbe99999abe4ccccdbdcccccd000000003dcccccd3e4ccccd3e99999a3ecccccd3f0000003f19999a3f3333333f4ccccd3f6666663f8000003f8ccccd3f99999a3fa666663fb33333',
    ggml: ['00b480848f7e7d6d6c6c5c5b4b4a4a3a3929', '08247f4081a7adb4bac0c7cdd4dae0e7edf3fa00060d131920262c333940464c5359'],
    dllama: ['00b480848f7e7d6d6c6c5c5b4b4a4a3a3929', '08247f4081a7adb4bac0c7cdd4dae0e7edf3fa00060d131920262c333940464c5359'],
  },
  {
    name: 'scale-overflow-q4',
    f32: '49742400000000003f80000040000000404000004080000040a0000040c0000040e0000041000000411000004120000041300000414000004150000041600000417000004180000041880000419000004198000041a0000041a8000041b0000041b8000041c0000041c8000041d0000041d8000041e0000041e8000041f00000',
    ggml: ['00fc80888888888888888888888888888888', 'b16f7f00000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['00fc80888888888888888888888888888888', 'b16f7f00000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'scale-overflow-q8',
    f32: 'cb18968000000000447a000044fa0000453b8000457a0000459c400045bb800045dac00045fa0000460ca000461c4000462be000463b8000464b2000465ac000466a6000467a00004684d000468ca00046947000469c400046a4100046abe00046b3b00046bb800046c3500046cb200046d2f00046dac00046e2900046ea6000',
    ggml: ['007c80888888888888888888888888888888', '007c8100000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['007c80888888888888888888888888888888', '007c8100000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'tiny',
    f32: '8fa242608f981e3a8f8dfa148f83d5ee8f7363908f5f1b448f4ad2f88f368aac8f2242608f0dfa148ef363908ecad2f88ea242608e7363908e2242608da24260000000000da242600e2242600e7363900ea242600ecad2f80ef363900f0dfa140f2242600f368aac0f4ad2f80f5f1b440f7363900f83d5ee0f8dfa140f981e3a',
    ggml: ['0000809191a2a2b3b3c4c4d5d5e6e6f7f7f8', '000081899199a1a9b1b9c0c8d0d8e0e8f0f8000810182028303840474f575f676f77'],
    dllama: ['0000809191a2a2b3b3c4c4d5d5e6e6f7f7f8', '000081899199a1a9b1b9c0c8d0d8e0e8f0f8000810182028303840474f575f676f77'],
  },
  {
    name: 'subnormal',
    f32: '000000000000000300000006000000090000000c0000000f0000001200000015000000180000001b0000001e0000002100000024000000270000002a0000002d80000001800000068000000b80000010800000158000001a8000001f80000024800000298000002e80000033800000388000003d80000042800000478000004c',
    ggml: ['000000000000000000000000000000000000', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['0000000f0f0f0f0f0f0f0f0f0f0f0f0f0f0f', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'xorshift-1-0.0625-0',
    gen: [1, 0.0625, 0],
    ggml: ['789f48c87f87ffa525b6802eff724de888cc', '880f00049813882f281c7fa9985fb00506c638c214ff87e258d703638b1541a004c8'],
    dllama: ['789f48c87f87ffa525b6802eff724de888cc', '880f00049813882f281c7fa9985fb00506c638c214ff87e258d703638b1541a004c8'],
  },
  {
    name: 'xorshift-1-0.0625-1',
    gen: [1, 0.0625, 1],
    ggml: ['979fd8ee22b46bb32580500d73cf486d5b4f', 'a60f03a85e3dcd48347f7eb24b8905b6cb88b39b58d019c962062d7e17c4391b2c3a'],
    dllama: ['979fd8ee22b46bb32580500d73cf486d5b4f', 'a60f03a85e3dcd48347f7eb24b8905b6cb88b39b58d019c962062d7e17c4391b2c3a'],
  },
  {
    name: 'xorshift-1-0.0625-2',
    gen: [1, 0.0625, 2],
    ggml: ['c09fd7bd9a7a609b7912698f2f62b9ae122d', 'cf0f0facdcdf7fd2ed58f592895befa25ab8b3cbea0c23ed14741cfd6720d8de6f5c'],
    dllama: ['c09fd7bd9a7a609b7912698f2f62b9ae122d', 'cf0f0facdcdf7fd2ed58f592895befa25ab8b3cbea0c23ed14741cfd6720d8de6f5c'],
  },
  {
    name: 'xorshift-1-0.0625-3',
    gen: [1, 0.0625, 3],
    ggml: ['fd9f40741da70aa77ed89fcce822745adc0c', '06107740ad09de179dff8ebcfd6444d9c7be430f70e27ce30db1eebda260152db67f'],
    dllama: ['fd9f40741da70aa77ed89fcce822745adc0c', '06107740ad09de179dff8ebcfd6444d9c7be430f70e27ce30db1eebda260152db67f'],
  },
  {
    name: 'xorshift-7-1.0-0',
    gen: [7, 1.0, 0],
    ggml: ['e4afc8a61a2d6df097c572f72ae6410f52eb', 'f41f001ce7b7aa7e10305f15e5266e8a61d1bae574661f8aeac71582599a457f349e'],
    dllama: ['e4afc8a61a2d6df097c572f72ae6410f52eb', 'f41f001ce7b7aa7e10305f15e5266e8a61d1bae574661f8aeac71582599a457f349e'],
  },
  {
    name: 'xorshift-7-1.0-1',
    gen: [7, 1.0, 1],
    ggml: ['d82f85b50af716f243af11a3923e424f07e9', 'e81fcdd51ff5e29fb4718baea1609d72ee130335877e896fc021931d0db0bfbf8166'],
    dllama: ['d82f85b50af716f243af11a3923e424f07e9', 'e81fcdd51ff5e29fb4718baea1609d72ee130335877e896fc021931d0db0bfbf8166'],
  },
  {
    name: 'xorshift-7-1.0-2',
    gen: [7, 1.0, 2],
    ggml: ['e82f5915a0a714b054ac29f4d85a4d0f3253', 'f71f0ed881e9c283c83b17bf011b49719caac9912224892ed322a06b57d1ba83b3cd'],
    dllama: ['e82f5915a0a714b054ac29f4d85a4d0f3253', 'f71f0ed881e9c283c83b17bf011b49719caac9912224892ed322a06b57d1ba83b3cd'],
  },
  {
    name: 'xorshift-7-1.0-3',
    gen: [7, 1.0, 3],
    ggml: ['adaf1059fef2fe9c0a0ff4ccfdf89d4d8dac', 'bd1f7df79d5da4c0e08542b9b401afb8b4c36b30879486ea7f7c87b98590ef3b07e0'],
    dllama: ['adaf1059fef2fe9c0a0ff4ccfdf89d4d8dac', 'bd1f7df79d5da4c0e08542b9b401afb8b4c36b30879486ea7f7c87b98590ef3b07e0'],
  },
  {
    name: 'xorshift-99-0.001-0',
    gen: [99, 0.001, 0],
    ggml: ['ff0718f1199f15bef12310b555ea979fb722', '8100028d137bcd5e8dac81ccce19eb75f4a5987b910d8a2c74a68e30ce600d112ea9'],
    dllama: ['ff0718f1199f15bef12310b555ea979fb722', '8100028d137bcd5e8dac81ccce19eb75f4a5987b910d8a2c74a68e30ce600d112ea9'],
  },
  {
    name: 'xorshift-99-0.001-1',
    gen: [99, 0.001, 1],
    ggml: ['f787c30f57532d3f49968031148c3e88a856', '80005397174baf8af2247b733fc69b07ff19bd7f293561483ff3f95768fa4dfde528'],
    dllama: ['f787c30f57532d3f49968031148c3e88a856', '80005397174baf8af2247b733fc69b07ff19bd7f293561483ff3f95768fa4dfde528'],
  },
  {
    name: 'xorshift-99-0.001-2',
    gen: [99, 0.001, 2],
    ggml: ['f807bdaa813633e69301fdb031a7b8f29499', '80004c1d8ddfb6d9ae974a848fea06a2c3103718fbadb55c13816f36b81d30751813'],
    dllama: ['f807bdaa813633e69301fdb031a7b8f29499', '80004c1d8ddfb6d9ae974a848fea06a2c3103718fbadb55c13816f36b81d30751813'],
  },
  {
    name: 'xorshift-99-0.001-3',
    gen: [99, 0.001, 3],
    ggml: ['db07b83056e20c32eb11a46f993127ef4c76', '7f000481dca0429c3691c4771697f57a43df32add65885ad628d24e611ada766bceb'],
    dllama: ['db07b83056e20c32eb11a46f993127ef4c76', '7f000481dca0429c3691c4771697f57a43df32add65885ad628d24e611ada766bceb'],
  },
  {
    name: 'xorshift-2024-3.0-0',
    gen: [2024, 3.0, 0],
    ggml: ['b335eaf27da01b0fbe9c7c6a2b7c6618e4fb', 'bf25219b49882f685a3844272b39deffc52c5879ef2297812f09f0e1a6f1e497647c'],
    dllama: ['b335eaf27da01b0fbe9c7c6a2b7c6618e4fb', 'bf25219b49882f685a3844272b39deffc52c5879ef2297812f09f0e1a6f1e497647c'],
  },
  {
    name: 'xorshift-2024-3.0-1',
    gen: [2024, 3.0, 1],
    ggml: ['dbb5d406e7146e1d088e47b0a9f8429ab327', 'e7253e20103d99b5ff99157fe8ff63e34f11b17aa66d216d78fa3ecce18b40f7ca5e'],
    dllama: ['dbb5d406e7146e1d088e47b0a9f8429ab327', 'e7253e20103d99b5ff99157fe8ff63e34f11b17aa66d216d78fa3ecce18b40f7ca5e'],
  },
  {
    name: 'xorshift-2024-3.0-2',
    gen: [2024, 3.0, 2],
    ggml: ['fcb5c6e40fd8738bfee12c62278caf001e1f', '08261c3f820748d2a175c86112c88479a698bea07fad1203859d5d275cffde776876'],
    dllama: ['fcb5c6e40fd8738bfee12c62278caf001e1f', '08261c3f820748d2a175c86112c88479a698bea07fad1203859d5d275cffde776876'],
  },
  {
    name: 'xorshift-2024-3.0-3',
    gen: [2024, 3.0, 3],
    ggml: ['cf35431cf96df1ece66b245b0bec83466b41', 'db25b1380b548f3ee034c72c343dafe02d96c28b7add72595adfa1d18163fdc5e5bf'],
    dllama: ['cf35431cf96df1ece66b245b0bec83466b41', 'db25b1380b548f3ee034c72c343dafe02d96c28b7add72595adfa1d18163fdc5e5bf'],
  },
  {
    name: 'f16-bits-0',
    f16: 'a0a51e0519c1eb4347e53db798e3dae1ad859e312e37e5d946a129da637bc1cbb252e325930978b082b855985fd90f41f77b98219390616284da1a78b8f6e2e0',
    ggml: ['b0ec8888880988888888e888888888888888', 'b95c000000f4000000ff000000fb0000030000fd007f000002009b000002000000fd'],
    dllama: ['b0ec8888880988888888e888888888888888', 'b95c000000f4000000ff000000fb0000030000fd007f000002009b000002000000fd'],
  },
  {
    name: 'f16-bits-1',
    f16: 'db7bfa0abfe2333cc1ebed4f5a40525a8932e06f2e59903a13dd6f8e3f6fede235ccbc5533e3cc2f4b8631c59023bdae9fc2e3146c6e4fa71c8e98148ca3ebaf',
    ggml: ['0a6e88808888888788888888988888898877', '165eff81000000f2010000ff0000001400f1000000000000000000fe0c00000000f6'],
    dllama: ['0a6e88808888888788888888988888898877', '165eff81000000f2010000ff0000001400f1000000000000000000fe0c00000000f6'],
  },
  {
    name: 'bf16-bits-0',
    bf16: '396bc20b3a6eb833bd47c6ff43bf38d3bdfd45aac5a13a85c747bfd8bb0e47f03f433bd2c6adc349bf2cc452bcfc3af5b9334758bb4f3efc3e06c0523dbfc186',
    ggml: ['80f388889888888a8888884888888b888880', '8f630000000000de00000006fb00cb00007f0000e90000ff00000039000000000000'],
    dllama: ['80f388889888888a8888884888888b888880', '8f630000000000de00000006fb00cb00007f0000e90000ff00000039000000000000'],
  },
  {
    name: 'bf16-bits-1',
    bf16: 'bec8bdacbfb9bbe546eac03cc15bbd38bf973969c351c6c94704b8733e3dbeae3ff8bef73b56c520c2cc3bd2c3f4b96abec5c71ab9b1479ec5f439ebc0cdbdd6',
    ggml: ['f0f0888888888588888888c8880b95888888', 'fa60000000002f000000000000d835000000000000fc0000ff0000c2007ff4000000'],
    dllama: ['f0f0888888888588888888c8880b95888888', 'fa60000000002f000000000000d835000000000000fc0000ff0000c2007ff4000000'],
  },
  {
    name: 'subnormal-d-0',
    f32: '003da969000abf41013759b000a15cf08150378f0095927f8099f5120047bb2f0063933e010cb87c006c90dd011c8226805c4a0a003d4ac480d6613601663d8e80a3208500c815dc0081bdc5009ba6b900db5cff00d40ffd8153bee880539e4f805d7a4281312108809c6000809487ce8140677800c8358f81448d5300b75824',
    ggml: ['0080b75862554f45fb97a6e3b6b3fa57fc50', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['0080b75862554f45fb97a6e3b6b3fa57fc50', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'subnormal-d-1',
    f32: '0080000501800006800000050180000081000002000000048180000781800007818000020000000000800005000000000080000780800002000000030180000100000007800000068180000481000006808000030100000581000002810000068080000780000007810000008000000700000005800000008100000101000003',
    ggml: ['00008a8f084f64c8404060884a888a8648cf', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['00008a8f084f64c8404060884a888a8648cf', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'subnormal-d-2',
    f32: '81f073628191166c80450602022c3b800054f82e8279c4c6814d577680d2a58701a44d3681dcc75701f6f60c815378378069e3bd01da3eb20186a97400200e6000ece5d6819fcb9d006436cb819a51f50235de4780d3259981ecf9c9016efd43011b0b20821fb67f825efeb7008ad81300183f378225e88880a80d1281cd13b7',
    ggml: ['00009456886ee87046a79b341c96883b7a58', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['00009456886ee87046a79b341c96883b7a58', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'subnormal-d-3',
    f32: '0180000280800000008000018200000001800002018000058080000582000007810000010280000680000001808000058200000482000004008000038080000202000003800000070100000702800000020000018180000600800002010000060100000200000000808000068280000482000006800000060000000601000006',
    ggml: ['00804689780c46a6897c798098f9cc8c8879', '00000000000000000000000000000000000000000000000000000000000000000000'],
    dllama: ['00804689780c46a6897c798098f9cc8c8879', '00000000000000000000000000000000000000000000000000000000000000000000'],
  },
  {
    name: 'subnormal-d-4',
    f32: '006249bf806045f50089f95a00f21dab82ad2ac802f75432025997ca01b9a85a026c74638068ce330370686481e1359a0014c1d30073b24481df33b9802d144d02b62e3f82c65fe7806b0b7a800244b882b50e32001b2a2b0295024481e6322a82ce569b033b70b58193ae8302b000a280af80f0008431e88192e37482f87b8a',
    ggml: ['008058b88888bb846697b6289059888899c8', '000002fe0204d2411d0c1ffe7ff10002f1ff30ccfe00d00027f1c963f62efd02f6be'],
    dllama: ['008058b88888bb846697b6289059888899c8', '000002fe0204d2411d0c1ffe7ff10002f1ff30ccfe00d00027f1c963f62efd02f6be'],
  },
  {
    name: 'subnormal-d-5',
    f32: '8180000683000006808000040200000281800001800000008200000082000001838000070080000082800001000000010100000580000000028000058080000602000001808000050380000183800000810000010280000182800001028000068280000501800005808000078180000382800003828000008100000283000004',
    ggml: ['00009884f80988a867a76098868868688a48', '0000f8c1fe10f800f0f08102e000040020fe10fe7f81fc20e020e008fef8e0e0fcc1'],
    dllama: ['00009884f80988a867a76098868868688a48', '0000f8c1fe10f800f0f08102e000040020fe10fe7f81fc20e020e008fef8e0e0fcc1'],
  },
];

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex');
const fromHex = (h: string): Uint8Array => new Uint8Array(Buffer.from(h, 'hex'));

function words(h: string, bytes: 2 | 4): number[] {
  const out: number[] = [];
  for (let i = 0; i < h.length; i += bytes * 2) out.push(parseInt(h.slice(i, i + bytes * 2), 16));
  return out;
}

function xorshiftBlock(seed: number, scale: number, block: number): Float32Array {
  let s = seed >>> 0;
  const out = new Float32Array(32);
  for (let b = 0; b <= block; b++) {
    for (let j = 0; j < 32; j++) {
      s = (s ^ (s << 13)) >>> 0;
      s = (s ^ (s >>> 17)) >>> 0;
      s = (s ^ (s << 5)) >>> 0;
      out[j] = Math.fround(((s | 0) / 2147483648) * scale);
    }
  }
  return out;
}

/** The float32 input of a golden case. */
function input(g: Golden): Float32Array {
  if (g.gen) return xorshiftBlock(...g.gen);
  if (g.f32) return new Float32Array(new Uint32Array(words(g.f32, 4)).buffer);
  if (g.f16) return Float32Array.from(words(g.f16, 2), f16BitsToF32);
  return new Float32Array(new Uint32Array(words(g.bf16!, 2).map((h) => h << 16)).buffer);
}

function codeOf(fn: () => unknown): string | undefined {
  try {
    fn();
  } catch (err) {
    return isConvertError(err) ? err.code : `not a ConvertError: ${String(err)}`;
  }
  return undefined;
}

function messageOf(fn: () => unknown): string {
  try {
    fn();
  } catch (err) {
    return (err as Error).message;
  }
  return '';
}

describe('golden blocks', () => {
  const flavors: QuantFlavor[] = ['ggml', 'dllama'];
  describe.each(flavors)('%s', (flavor) => {
    test.each(GOLDEN.map((g) => [g.name, g] as const))('%s from float32', (_name, g) => {
      const x = input(g);
      const q4 = new Uint8Array(Q40_BLOCK_BYTES);
      const q8 = new Uint8Array(Q80_BLOCK_BYTES);
      quantizeQ40(x, q4, { flavor });
      quantizeQ80(x, q8, { flavor });
      expect([hex(q4), hex(q8)]).toEqual(g[flavor]);
    });

    test.each(GOLDEN.filter((g) => g.f16 || g.bf16).map((g) => [g.name, g] as const))('%s from 16-bit bits', (_name, g) => {
      const dtype = g.f16 ? 'F16' : 'BF16';
      const bits = new Uint16Array(words((g.f16 ?? g.bf16)!, 2));
      const q4 = new Uint8Array(Q40_BLOCK_BYTES);
      const q8 = new Uint8Array(Q80_BLOCK_BYTES);
      quantizeQ40Half(bits, dtype, q4, { flavor });
      quantizeQ80Half(bits, dtype, q8, { flavor });
      expect([hex(q4), hex(q8)]).toEqual(g[flavor]);
    });
  });

  test('all golden blocks at once, at an output offset, through encodeChunk', () => {
    for (const flavor of flavors) {
      const x = new Float32Array(GOLDEN.length * 32);
      GOLDEN.forEach((g, i) => x.set(input(g), i * 32));
      const out = new Uint8Array(3 + GOLDEN.length * Q80_BLOCK_BYTES);
      const bytes = new Uint8Array(x.buffer);
      expect(encodeChunk({ dtype: 'F32', bytes }, 'q80', out, { flavor, outOffset: 3 })).toBe(GOLDEN.length * Q80_BLOCK_BYTES);
      expect(hex(out.subarray(3))).toBe(GOLDEN.map((g) => g[flavor][1]).join(''));
      const out4 = new Uint8Array(GOLDEN.length * Q40_BLOCK_BYTES);
      encodeChunk({ dtype: 'F32', bytes }, 'q40', out4, { flavor });
      expect(hex(out4)).toBe(GOLDEN.map((g) => g[flavor][0]).join(''));
    }
  });
});

describe('rounding rules, spelled out', () => {
  const golden = (name: string): Golden => GOLDEN.find((g) => g.name === name)!;
  const quants8 = (h: string): number[] => [...new Int8Array(fromHex(h).buffer, 2, 32)];
  const nibbles = (h: string): number[] => {
    const qs = fromHex(h).subarray(2);
    return [...[...qs].map((b) => b & 15), ...[...qs].map((b) => b >> 4)];
  };
  const scale = (h: string): number => f16BitsToF32(fromHex(h)[0]! | (fromHex(h)[1]! << 8));

  test('q8: x·id = k + 0.5 rounds away from zero in ggml, to even in dllama', () => {
    // block: 127 (so d = 1, id = 1), then 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5
    const g = golden('q8-ties');
    expect(quants8(g.ggml[1]).slice(0, 8)).toEqual([127, 1, 2, 3, -1, -2, -3, 127]);
    expect(quants8(g.dllama[1]).slice(0, 8)).toEqual([127, 0, 2, 2, 0, -2, -2, 126]);
  });

  test('q4: x·id + 8.5 truncates, so halves round up in both flavors', () => {
    // block: -8 (so d = 1, id = 1), then 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 7.5, -7.5
    for (const f of ['ggml', 'dllama'] as const) {
      expect(scale(golden('q4-ties')[f][0])).toBe(1);
      expect(nibbles(golden('q4-ties')[f][0]).slice(0, 9)).toEqual([0, 9, 8, 10, 7, 11, 6, 15, 1]);
    }
  });

  test('all-zero blocks: ggml scale signs are fixed, dllama follows the last element', () => {
    expect(golden('zeros').ggml).toEqual(['0080' + '88'.repeat(16), '0000' + '00'.repeat(32)]);
    expect(golden('neg-zeros').ggml).toEqual(['0080' + '88'.repeat(16), '0000' + '00'.repeat(32)]);
    expect(golden('zeros-last-neg').dllama).toEqual(['0000' + '88'.repeat(16), '0080' + '00'.repeat(32)]);
    expect(golden('zeros-last-pos').dllama).toEqual(['0080' + '88'.repeat(16), '0000' + '00'.repeat(32)]);
  });

  test('a negative maximum gives a positive q4 scale, and the maximum maps to nibble 0', () => {
    const g = golden('neg-max'); // x[0] = -3 is the largest magnitude
    for (const f of ['ggml', 'dllama'] as const) {
      expect(scale(g[f][0])).toBeCloseTo(3 / 8, 3);
      expect(nibbles(g[f][0])[0]).toBe(0);
      expect(quants8(g[f][1])[0]).toBe(-127);
    }
  });

  test('|min| = max: ggml takes the first, dllama the positive one', () => {
    const g = golden('abs-tie-neg-first'); // -2 comes before +2
    expect(scale(g.ggml[0])).toBe(0.25);
    expect(scale(g.dllama[0])).toBe(-0.25);
    const p = golden('abs-tie-pos-first');
    expect(scale(p.ggml[0])).toBe(-0.25);
    expect(scale(p.dllama[0])).toBe(-0.25);
  });

  test('one huge value flattens the rest of the block', () => {
    const g = golden('one-huge'); // 30000 among values below 0.003
    expect(nibbles(g.ggml[0]).filter((q) => q !== 8)).toEqual([0]);
    expect(quants8(g.ggml[1]).filter((q) => q !== 0)).toEqual([127]);
  });
});

describe('non-finite input and block sizes', () => {
  const bad = [NaN, Infinity, -Infinity];
  test.each(bad)('%p is rejected with NonFinite naming the tensor and element', (v) => {
    const x = new Float32Array(64).fill(0.5);
    x[37] = v;
    const opts = { label: 'model.layers.3.mlp.up_proj.weight', elementOffset: 1000 };
    for (const fn of [quantizeQ40, quantizeQ80]) {
      expect(codeOf(() => fn(x, new Uint8Array(68), opts))).toBe('NonFinite');
      expect(messageOf(() => fn(x, new Uint8Array(68), opts))).toMatch(/model\.layers\.3\.mlp\.up_proj\.weight.*element 1037/);
    }
    expect(codeOf(() => assertFinite(x, 't'))).toBe('NonFinite');
    expect(codeOf(() => encodeChunk({ dtype: 'F32', bytes: new Uint8Array(x.buffer) }, 'f16', new Uint8Array(128)))).toBe('NonFinite');
    expect(codeOf(() => encodeChunk({ dtype: 'F32', bytes: new Uint8Array(x.buffer) }, 'f32', new Uint8Array(256)))).toBe('NonFinite');
  });

  test.each([
    ['F16', 0x7c00],
    ['F16', 0xfc00],
    ['F16', 0x7e01],
    ['BF16', 0x7f80],
    ['BF16', 0xff80],
    ['BF16', 0x7fc1],
  ] as const)('%s bits %p are rejected', (dtype, bits) => {
    const h = new Uint16Array(64).fill(0x3c00);
    h[40] = bits;
    for (const fn of [quantizeQ40Half, quantizeQ80Half]) {
      expect(codeOf(() => fn(h, dtype, new Uint8Array(68), { label: 't' }))).toBe('NonFinite');
      expect(messageOf(() => fn(h, dtype, new Uint8Array(68), { label: 't' }))).toMatch(/element 40/);
    }
    expect(codeOf(() => decodeToF32({ dtype, bytes: new Uint8Array(h.buffer) }))).toBe('NonFinite');
  });

  test('values that overflow an f16 output are rejected', () => {
    const x = Float32Array.of(1, 65519.99, -65520, 0);
    expect(codeOf(() => f32ToF16(x, new Uint16Array(4)))).toBe('NonFinite');
    expect(messageOf(() => f32ToF16(x, new Uint16Array(4), { label: 'w' }))).toMatch(/w: element 2 overflows f16: -65520/);
    const bf = new Uint16Array([0x4780]); // bf16 65536
    expect(codeOf(() => encodeChunk({ dtype: 'BF16', bytes: new Uint8Array(bf.buffer) }, 'f16', new Uint8Array(2)))).toBe('NonFinite');
  });

  test('block formats need a multiple of 32 values', () => {
    expect(codeOf(() => quantizeQ40(new Float32Array(33), new Uint8Array(64)))).toBe('BadBlockSize');
    expect(codeOf(() => quantizeQ80Half(new Uint16Array(16), 'F16', new Uint8Array(64)))).toBe('BadBlockSize');
    expect(codeOf(() => encodedSize('q40', 48))).toBe('BadBlockSize');
    expect(encodedSize('q40', 64)).toBe(36);
    expect(encodedSize('q80', 64)).toBe(68);
    expect(encodedSize('f16', 3)).toBe(6);
    expect(encodedSize('f32', 3)).toBe(12);
  });
});

describe('fp16', () => {
  test('values checked against ggml_compute_fp32_to_fp16', () => {
    // float32 bits → fp16 bits, from the C harness
    const cases: [number, number][] = [
      [0x00000000, 0x0000],
      [0x80000000, 0x8000],
      [0x3f800000, 0x3c00],
      [0x477fe000, 0x7bff],
      [0x477fefff, 0x7bff],
      [0x477ff000, 0x7c00],
      [0x7f7fffff, 0x7c00],
      [0x7f800000, 0x7c00],
      [0xff800000, 0xfc00],
      [0x7fc00000, 0x7e00],
      [0x33000000, 0x0000],
      [0x33000001, 0x0001],
      [0x32ffffff, 0x0000],
      [0x33400000, 0x0001],
      [0x33c00000, 0x0002],
      [0x387fc000, 0x03ff],
      [0x38800000, 0x0400],
      [0x3dcccccd, 0x2e66],
      [0x3eaaaaab, 0x3555],
      [0x3f801000, 0x3c00],
      [0x3f803000, 0x3c02],
      [0x3f800fff, 0x3c00],
      [0x3f801001, 0x3c01],
      [0xc7000100, 0xf800],
      [0xc7000080, 0xf800],
      [0x00000001, 0x0000],
      [0x0000ffff, 0x0000],
      [0x38ffe000, 0x07ff],
    ];
    for (const [f, h] of cases) expect([f, f16FromF32Bits(f)]).toEqual([f, h]);
  });

  test('exhaustively: every fp16 value round-trips, and midpoints round to even', () => {
    const f32 = new Float32Array(1);
    const u32 = new Uint32Array(f32.buffer);
    const bitsOf = (v: number): number => ((f32[0] = v), u32[0]!);
    let failures = 0;
    for (let h = 0; h < 0x7c00; h++) {
      for (const sign of [0, 0x8000]) {
        const v = f16BitsToF32(h | sign);
        if (f32ToF16Bits(v) !== (h | sign)) failures++;
        if (h === 0x7bff) continue;
        const mid = (v + f16BitsToF32((h + 1) | sign)) / 2; // exact in float32 (12 significant bits)
        const m = bitsOf(mid);
        const even = (h & 1) === 0 ? h : h + 1;
        if (f16FromF32Bits(m) !== (even | sign)) failures++;
        if (f16FromF32Bits(m + 1) !== ((h + 1) | sign)) failures++; // just beyond the midpoint
        if (f16FromF32Bits(m - 1) !== (h | sign)) failures++; // just before it
      }
    }
    expect(failures).toBe(0);
  });

  test('lookup tables match ggml_compute_fp16_to_fp32 and bf16 widening', () => {
    const f = new Float32Array(1);
    const u = new Uint32Array(f.buffer);
    let hash = 0x811c9dc5;
    for (let h = 0; h < 65536; h++) {
      if ((h & 0x7c00) === 0x7c00 && (h & 0x3ff) !== 0) continue;
      f[0] = F16_TABLE[h]!;
      hash = Math.imul(hash ^ u[0]!, 0x01000193) >>> 0;
    }
    expect(hash.toString(16)).toBe('2be6b7cd');
    for (let h = 0; h < 65536; h += 7) {
      if ((h & 0x7f80) === 0x7f80 && (h & 0x7f) !== 0) continue;
      expect(f32Bits(BF16_TABLE[h]!)).toBe((h << 16) >>> 0);
    }
  });
});

describe('consistency between input types', () => {
  function randomHalf(n: number, dtype: 'F16' | 'BF16', seed: number): Uint16Array {
    let s = seed;
    const out = new Uint16Array(n);
    for (let i = 0; i < n; i++) {
      s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
      let h = s >>> 16;
      if (dtype === 'F16' && (h & 0x7c00) === 0x7c00) h &= 0xbfff;
      if (dtype === 'BF16') h = (h & 0x807f) | ((0x60 + ((h >>> 7) & 0x3f)) << 7);
      if (i % 97 < 3) h &= 0x8000; // some zeros, some all-zero runs
      out[i] = h;
    }
    for (let i = 32 * 5; i < 32 * 6; i++) out[i] = i % 2 ? 0x8000 : 0;
    return out;
  }

  test.each(['F16', 'BF16'] as const)('%s bits give the same blocks as their float32 values', (dtype) => {
    const n = 32 * 2000;
    const h = randomHalf(n, dtype, dtype === 'F16' ? 7 : 11);
    const x = decodeToF32({ dtype, bytes: new Uint8Array(h.buffer) });
    for (const flavor of ['ggml', 'dllama'] as const) {
      for (const [half, full, size] of [
        [quantizeQ40Half, quantizeQ40, Q40_BLOCK_BYTES],
        [quantizeQ80Half, quantizeQ80, Q80_BLOCK_BYTES],
      ] as const) {
        const a = new Uint8Array((n / 32) * size);
        const b = new Uint8Array((n / 32) * size);
        half(h, dtype, a, { flavor });
        full(x, b, { flavor });
        expect(hex(a)).toBe(hex(b));
      }
    }
  });

  test('unaligned inputs and outputs give the same bytes', () => {
    const h = randomHalf(32 * 10 + 1, 'F16', 3);
    const aligned = h.slice(0, 320);
    const shifted = new Uint16Array(321);
    shifted.set(aligned, 1);
    const unaligned = shifted.subarray(1); // byteOffset 2: not 4-byte aligned
    const a = new Uint8Array(10 * Q40_BLOCK_BYTES);
    const b = new Uint8Array(10 * Q40_BLOCK_BYTES);
    quantizeQ40Half(aligned, 'F16', a);
    quantizeQ40Half(unaligned, 'F16', b);
    expect(hex(a)).toBe(hex(b));
    const bytes = new Uint8Array(new Uint8Array(aligned.buffer).length + 1);
    bytes.set(new Uint8Array(aligned.buffer), 1);
    const odd = bytes.subarray(1); // byteOffset 1
    const f16 = new Uint8Array(641);
    encodeChunk({ dtype: 'F16', bytes: odd }, 'f16', f16, { outOffset: 1 });
    expect(hex(f16.subarray(1))).toBe(hex(new Uint8Array(aligned.buffer)));
    const f32 = new Uint8Array(1283);
    encodeChunk({ dtype: 'F16', bytes: odd }, 'f32', f32, { outOffset: 3 });
    expect([...new Float32Array(f32.slice(3).buffer)]).toEqual([...aligned].map(f16BitsToF32));
  });

  test('f16 output from float32 equals the scalar conversion', () => {
    const x = Float32Array.from({ length: 4096 }, (_, i) => Math.sin(i) * 2 ** ((i % 40) - 30));
    const out = new Uint8Array(8192);
    encodeChunk({ dtype: 'F32', bytes: new Uint8Array(x.buffer) }, 'f16', out);
    expect([...new Uint16Array(out.buffer)]).toEqual([...x].map(f32ToF16Bits));
  });
});
