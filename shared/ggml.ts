/**
 * ggml's tensor types (ggml.h `ggml_type`), declared once: the id a GGUF file stores, the name
 * llama.cpp prints, and the block layout — values per block and bytes per block, as gguf-py's
 * `GGML_QUANT_SIZES` gives them. The GGUF writer sizes what it writes by it, the reader sizes
 * every tensor of a file it reads, the dequantizer finds its blocks by it, messages name types by
 * it, and each weights format names its ggml type here (weights.ts).
 *
 * Ids ggml has retired (Q4_2, Q4_3, the repacked Q4_0_x_x and IQ4_NL_x_x) keep their names and no
 * layout: a file holding one is read without knowing those tensors' lengths.
 * Workflow-safe: no imports, no I/O.
 */

/** A ggml type: its id, and its block layout when ggml still has one. */
export interface GgmlTypeDeclaration {
  id: number;
  /** Values per block (1 for the plain types). */
  blockSize?: number;
  /** Bytes per block. */
  typeSize?: number;
}

/** Every ggml type, by name, in id order. */
export const GGML_TYPES = {
  F32: { id: 0, blockSize: 1, typeSize: 4 },
  F16: { id: 1, blockSize: 1, typeSize: 2 },
  Q4_0: { id: 2, blockSize: 32, typeSize: 18 },
  Q4_1: { id: 3, blockSize: 32, typeSize: 20 },
  Q4_2: { id: 4 },
  Q4_3: { id: 5 },
  Q5_0: { id: 6, blockSize: 32, typeSize: 22 },
  Q5_1: { id: 7, blockSize: 32, typeSize: 24 },
  Q8_0: { id: 8, blockSize: 32, typeSize: 34 },
  Q8_1: { id: 9, blockSize: 32, typeSize: 40 },
  Q2_K: { id: 10, blockSize: 256, typeSize: 84 },
  Q3_K: { id: 11, blockSize: 256, typeSize: 110 },
  Q4_K: { id: 12, blockSize: 256, typeSize: 144 },
  Q5_K: { id: 13, blockSize: 256, typeSize: 176 },
  Q6_K: { id: 14, blockSize: 256, typeSize: 210 },
  Q8_K: { id: 15, blockSize: 256, typeSize: 292 },
  IQ2_XXS: { id: 16, blockSize: 256, typeSize: 66 },
  IQ2_XS: { id: 17, blockSize: 256, typeSize: 74 },
  IQ3_XXS: { id: 18, blockSize: 256, typeSize: 98 },
  IQ1_S: { id: 19, blockSize: 256, typeSize: 50 },
  IQ4_NL: { id: 20, blockSize: 32, typeSize: 18 },
  IQ3_S: { id: 21, blockSize: 256, typeSize: 110 },
  IQ2_S: { id: 22, blockSize: 256, typeSize: 82 },
  IQ4_XS: { id: 23, blockSize: 256, typeSize: 136 },
  I8: { id: 24, blockSize: 1, typeSize: 1 },
  I16: { id: 25, blockSize: 1, typeSize: 2 },
  I32: { id: 26, blockSize: 1, typeSize: 4 },
  I64: { id: 27, blockSize: 1, typeSize: 8 },
  F64: { id: 28, blockSize: 1, typeSize: 8 },
  IQ1_M: { id: 29, blockSize: 256, typeSize: 56 },
  BF16: { id: 30, blockSize: 1, typeSize: 2 },
  Q4_0_4_4: { id: 31 },
  Q4_0_4_8: { id: 32 },
  Q4_0_8_8: { id: 33 },
  TQ1_0: { id: 34, blockSize: 256, typeSize: 54 },
  TQ2_0: { id: 35, blockSize: 256, typeSize: 66 },
  IQ4_NL_4_4: { id: 36 },
  IQ4_NL_4_8: { id: 37 },
  IQ4_NL_8_8: { id: 38 },
  MXFP4: { id: 39, blockSize: 32, typeSize: 17 },
} as const satisfies Record<string, GgmlTypeDeclaration>;

export type GgmlTypeName = keyof typeof GGML_TYPES;
/** The names of the types that have a block layout (not retired). */
export type GgmlLayoutName = { [K in GgmlTypeName]: (typeof GGML_TYPES)[K] extends { blockSize: number } ? K : never }[GgmlTypeName];

/** A ggml type with a block layout, looked up by id. */
export interface GgmlLayout {
  name: GgmlTypeName;
  id: number;
  blockSize: number;
  typeSize: number;
}

const BY_ID: ReadonlyMap<number, { name: GgmlTypeName } & GgmlTypeDeclaration> = new Map(
  (Object.entries(GGML_TYPES) as [GgmlTypeName, GgmlTypeDeclaration][]).map(([name, t]) => [t.id, { name, ...t }]),
);

/** The name of ggml type `id` (`type 42` when ggml has no such type). */
export function ggmlTypeName(id: number): string {
  return BY_ID.get(id)?.name ?? `type ${id}`;
}

/** The block layout of ggml type `id`, or undefined when the id is unknown or retired. */
export function ggmlLayout(id: number): GgmlLayout | undefined {
  const t = BY_ID.get(id);
  return t?.blockSize !== undefined && t.typeSize !== undefined ? { name: t.name, id: t.id, blockSize: t.blockSize, typeSize: t.typeSize } : undefined;
}
