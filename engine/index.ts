/**
 * The llama.cpp engine (node-llama-cpp) with the HTTP API of distributed-llama's `dllama-api`, so
 * a bridge serves either the same way. See README.md for the contract; `magus engine` is
 * workers/engine.ts.
 */
export { ENGINE_USAGE, parseEngineArgs, type EngineOptions } from './options';
export { startEngine, type LoadedEngine, type RunningEngine, type Standby } from './server';
export { createEngineHttp, engineApi, COMPLETIONS_URL, type EngineApiOptions } from './app';
export { EngineCore, type EngineStatus } from './core';
export * from './api';
